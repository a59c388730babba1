"""The workload-aware policy: evict the lowest alpha*P_reuse + beta*S_locality + gamma*T_window
(the score: :mod:`.scoring`).

Two implementations of one rule:

``workload_aware`` (amortised O(1)): each class's pages sit in time buckets by release time; within
a bucket pages are ordered by locality level, FIFO within a level (pages of one class and bucket
share their reuse probability, so that is their score order). Eviction looks only at the top of each
class's oldest bucket, scores those few candidates at the current time and takes the lowest: age
orders buckets, the class's fitted reuse curve trades an old page of a class that comes back against
a young one of a class that does not. A sparse oldest bucket is merged into its neighbour so that
the choice stays a choice. A protected segment (``protectedPercent`` of the pages) keeps the pages
that score in the top share when released; it is evicted from only when nothing else is left, and a
page leaves it when its current score drops out of the top share or its window expires.

``workload_aware_exact`` (:mod:`.workload_exact`) evaluates the full score, at eviction time, of every
candidate that can be the minimum: the yardstick of this policy's decisions.

Both rank pages by (expired, score): a page past its class's window goes before any page inside it,
whatever its score (a stale system prompt must not outlive a fresh conversation).

``workload_aware`` names only pages without cached descendants (leaves of the pool's prefix tree): a
prefix is worth at least what its continuations are. A page that comes up with descendants is set
aside (deferred) and goes back to its queue, with its release time, once its last child has gone.
Ranked alone, a system prompt last released by a low-value class would be evicted before the fresh
chats under it, and the pool would have to evict all of them with it: on the synthetic to-C trace at
1 % that was 534,000 of 2.34 million evictions.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from heapq import heapify, heappop, heapreplace
from itertools import islice

from kvpool_sidecar.config import KVCachePolicySpec
from kvpool_sidecar.policies.base import NO_PAGE, PageTree, PolicyContext, has_unnamed_child
from kvpool_sidecar.policies.class_queue import BID, KLASS, LEVEL, MERGE_BELOW, PAGE, RELEASED, ClassQueue
from kvpool_sidecar.policies.scoring import LOCALITY_LEVELS, Scoring, TopShare
from kvpool_sidecar.workload import reuse_within

_DEMOTE_PER_CALL = 32
_RECHECK_PER_CALL = 32  # deferred pages looked at again per new ``now`` (descendants gone unnamed)


def _by_class(ranked: list[tuple]) -> dict[Hashable, tuple]:
    """Rank tuples (one per class) keyed by their entry's class."""
    return {cand[4][KLASS]: cand for cand in ranked}


class WorkloadAwarePolicy(Scoring):
    name = "workload_aware"
    bulk = True

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self._queues: dict[Hashable, ClassQueue] = {}
        # Evictable page -> its entry (None: not evictable), a list indexed by page id: a dict of a
        # million pages costs seven times the memory and a cache miss more per eviction. Grown to the
        # page ids the partition has seen, not sized to the pool.
        self._entry: list[list | None] = []
        self._count = 0
        self._protected: OrderedDict[int, list] = OrderedDict()  # page -> entry, oldest first
        self._inserted = 0  # pages inserted: every fourth one's score is sampled for the threshold
        self._cands: dict[Hashable, tuple] = {}  # class -> its eviction candidate, ranked at _cands_now
        self._cands_now = math.nan
        self._base: dict[tuple, tuple[bool, float]] = {}  # (class, released) -> (fresh, score w/o locality)
        # class -> (p, rate, window, P(a gap under the window)) at _cands_now
        self._params: dict[Hashable, tuple[float, float, float, float]] = {}
        self._dirty: set[Hashable] = set()  # classes whose candidate may have changed
        self._top_share = TopShare()  # the score above which a released page is protected
        # Pages passed over because they have cached descendants (page -> entry, out of the queues):
        # a prefix is worth at least what its continuations are, so a page goes after its subtree
        # (a page's rank alone would let a stale system prompt take every chat under it along).
        self._deferred: dict[int, list] = {}
        tree = ctx.tree
        self._tree = tree if tree is not None else PageTree((), (), ())

    def configure(self, spec: KVCachePolicySpec) -> None:
        super().configure(spec)
        self._top = self.alpha + self.beta + self.gamma
        self._cands_now = math.nan  # ranks were computed with the old weights

    def _queue(self, klass: Hashable) -> ClassQueue:
        queue = self._queues.get(klass)
        if queue is None:
            queue = self._queues[klass] = ClassQueue()
        return queue

    def _push(self, entry: list) -> None:
        klass = entry[KLASS]
        self._queue(klass).push(entry)
        self._dirty.add(klass)

    def insert(self, pages: list[int], depths: Sequence[int], length: int, now: float, klass: Hashable) -> None:
        p, lam, window = self.model.params(klass)
        base = self.base_rank(p, lam, window, reuse_within(lam, window), 0.0)[1]  # the score at release
        beta = self.beta_level
        bid = int(now // self.bucket_width)
        threshold = self._top_share.threshold
        entries = self._entry
        if max(pages) >= len(entries):  # a policy used outside a pool learns its size as it goes
            entries.extend([None] * (max(pages) + 1 - len(entries)))
        protected = self._protected
        queue = self._queue(klass)
        self._dirty.add(klass)
        self._count += len(pages)
        # queue.push and locality_level, inlined: this loop runs for every released page
        bucket = queue.buckets.get(bid)
        low = queue.low[bid] if bucket is not None else LOCALITY_LEVELS
        pushed = 0
        inserted = self._inserted
        for page, depth in zip(pages, depths, strict=True):
            level = LOCALITY_LEVELS - (depth * LOCALITY_LEVELS) // length if depth < length else 1
            score = base + beta * level
            inserted += 1
            entry = [page, bid, klass, now, level]
            entries[page] = entry
            if not inserted & 3:
                self._top_share.note(score, self._top, self.protected_share)  # 1 in 4 is plenty
            if score >= threshold:
                protected[page] = entry
            else:
                if bucket is None:
                    bucket = queue.bucket(bid)
                bucket[level].append(entry)
                pushed += 1
                if level < low:
                    low = level
        self._inserted = inserted
        if pushed:
            queue.live[bid] += pushed
            queue.low[bid] = low
        limit = self.protected_share * self._count
        while len(protected) > limit:
            _, entry = protected.popitem(last=False)
            self._push(entry)

    def take(self, page: int, now: float, hit: bool) -> None:
        self._forget(page)

    def evict(self, page: int) -> None:
        self._forget(page)

    def _forget(self, page: int) -> None:
        entry = self._entry[page] if page < len(self._entry) else None
        if entry is None:
            raise KeyError(page)
        self._entry[page] = None
        self._count -= 1
        if self._protected.pop(page, None) is not None or self._deferred.pop(page, None) is not None:
            return
        entry[PAGE] = -1  # lazy deletion from its FIFO (skipped when it reaches the front)
        klass = entry[KLASS]
        self._queues[klass].discard(entry[BID])
        self._dirty.add(klass)

    def _candidate(self, queue: ClassQueue, now: float) -> tuple:
        return self._ranked(queue.front(), now)

    def _ranked(self, entry: list, now: float) -> tuple:
        released = entry[RELEASED]
        fresh, score = self._base_rank(entry[KLASS], released, now)
        # (rank..., page, entry, score without locality): the page id is unique, so tuples
        # compare on the rank alone; the last item lets the next page released with it skip the lookup
        return (fresh, score + self.beta_level * entry[LEVEL], released, entry[PAGE], entry, score)

    def _base_rank(self, klass: Hashable, released: float, now: float) -> tuple[bool, float]:
        """(fresh, score without locality); pages released together share it, computed once per ``now``."""
        base = self._base.get((klass, released))
        if base is None:
            p, lam, window, within = self._params.get(klass) or self._class_params(klass)
            base = self._base[(klass, released)] = self.base_rank(p, lam, window, within, now - released)
        return base

    def _class_params(self, klass: Hashable) -> tuple[float, float, float, float]:
        """(p, rate, window, P(a gap under the window)) of ``klass``, kept until the next ``now``."""
        p, lam, window = self.model.params(klass)
        params = self._params[klass] = (p, lam, window, reuse_within(lam, window))
        return params

    def _best(self, now: float) -> list:
        """The entry to evict next, left in place: the lowest-ranked page without cached descendants."""
        queues = self._queues
        cands = self._cands
        dirty = self._dirty
        if now != self._cands_now:
            # Ranks hold while ``now`` does (the model's fit moves between requests, not within one):
            # re-rank every candidate once per new ``now``, then only the classes touched since. A
            # class untouched since keeps its candidate page (every change to a queue marks it dirty).
            self._cands_now = now
            self._base.clear()
            self._params.clear()
            self._expire_protection(now)
            if self._deferred:
                self._recheck_deferred()
            for klass, cand in cands.items():
                if klass not in dirty:
                    cands[klass] = self._ranked(cand[4], now)
        if dirty:
            for klass in dirty:
                queue = queues.get(klass)
                if queue is not None and queue.order:
                    cands[klass] = self._candidate(queue, now)
                else:
                    cands.pop(klass, None)
            dirty.clear()
        first_child = self._tree.first_child
        while True:
            if cands:
                entry = min(cands.values())[4]  # one candidate per class: the top of its oldest bucket
            elif self._protected:
                entry = next(iter(self._protected.values()))
            else:  # every page left has cached descendants: unreachable while the tree is consistent
                return next(iter(self._deferred.values()))
            if not first_child or first_child[entry[PAGE]] == NO_PAGE:
                return entry
            self._defer(entry, now)

    def _defer(self, entry: list, now: float) -> None:
        """Pass over ``entry`` (the current best, which has cached descendants) until they are gone."""
        page = entry[PAGE]
        if self._protected.pop(page, None) is None:
            klass = entry[KLASS]
            queue = self._queues[klass]
            if queue.advance(entry) is None:
                del self._cands[klass]
            else:
                self._cands[klass] = self._candidate(queue, now)
        self._deferred[page] = entry

    def _undefer(self, page: int) -> Hashable:
        """Back into its queue, with its release time: it competes on its own rank again."""
        entry = self._deferred.pop(page)
        klass = entry[KLASS]
        (self._queues.get(klass) or self._queue(klass)).push(entry)
        return klass

    def _recheck_deferred(self) -> None:
        """The oldest few deferred pages go back if their descendants left without being named by this
        policy (taken into use and then released elsewhere, or cached in the other partition)."""
        deferred = self._deferred
        first_child = self._tree.first_child
        for page in list(islice(deferred, _RECHECK_PER_CALL)):
            if first_child[page] == NO_PAGE:
                self._dirty.add(self._undefer(page))
            else:
                deferred[page] = deferred.pop(page)  # to the back of the round

    def peek(self, now: float) -> int:
        return self._best(now)[PAGE]

    def victim(self, now: float) -> int:
        entry = self._best(now)
        page = entry[PAGE]
        if self._protected.pop(page, None) is None and self._deferred.pop(page, None) is None:
            klass = entry[KLASS]
            self._queues[klass].pop_front(entry)
            self._dirty.add(klass)
        self._entry[page] = None
        self._count -= 1
        parent_of = self._tree.parent
        if parent_of:
            parent = parent_of[page]
            if parent in self._deferred and not has_unnamed_child(parent, self._tree[1:], (page,)):
                self._dirty.add(self._undefer(parent))
        return page

    # hot loop: every page a full pool evicts passes here; helpers would cost a call per victim
    def victims(self, now: float, count: int, links: tuple[Sequence[int], Sequence[int]]) -> list[int]:
        """:meth:`victim` ``count`` times in one call. A page with a child not named yet is passed
        over (deferred) until its descendants are gone, so the pool never has to cascade; should
        only such pages be left, one is named and the call stops there (the pool then evicts its
        descendants with it)."""
        first_child, next_sib = links
        parent_of = self._tree.parent
        self._best(now)  # candidates up to date for ``now``
        cands = self._cands
        queues = self._queues
        entries = self._entry
        protected = self._protected
        deferred = self._deferred
        beta_level = self.beta_level
        alpha, gamma, exp = self.alpha, self.gamma, math.exp
        named: dict[int, None] = {}  # the pages named so far, in order
        stop = False
        # The candidates as a heap: a victim replaces its class's candidate with the next page of that
        # class, which mostly stays on top (a sift of one or two comparisons, not a min over every
        # class). The heap is the truth during the call; ``cands`` is brought back in line from it
        # when a class is undeferred (rare) and at the end.
        heap = list(cands.values())
        heapify(heap)
        remaining = count
        while remaining > 0 and not stop:
            undefer = NO_PAGE  # a deferred parent whose last child this run named
            if heap:
                # A run: pages of the best class, taken in its queue's order while the next one still
                # ranks below every other class's candidate (no heap operation, no rank tuple).
                best = heap[0]
                n = len(heap)
                if n > 1:
                    second = heap[1] if n == 2 or heap[1] < heap[2] else heap[2]
                    second_fresh, second_rank = second[0], second[1]
                else:
                    second_fresh, second_rank = True, math.inf
                entry = best[4]
                klass = entry[KLASS]
                queue = queues[klass]
                buckets, lives = queue.buckets, queue.live
                fresh, score, released = best[0], best[5], best[2]
                p, lam, window, within = self._params.get(klass) or self._class_params(klass)
                # The run stops at a rank of ``limit`` or more: the runner-up's rank when it is as fresh,
                # never when only the runner-up is fresh (an expired page goes first), at once when
                # only this class's page is
                limit = second_rank if fresh == second_fresh else (math.inf if second_fresh else -math.inf)
                halt = False  # stop or undefer: the run ends after this page
                bid = entry[BID]
                fifo = buckets[bid][entry[LEVEL]]
                live = lives[bid]  # written back when the run leaves this FIFO
                while True:
                    # queue.advance(entry), its usual case inlined: the next page of the same FIFO
                    fifo.popleft()
                    live -= 1
                    moved = True  # the next page is in another FIFO (or there is none)
                    if live >= MERGE_BELOW:
                        while fifo and fifo[0][PAGE] < 0:
                            fifo.popleft()
                        if fifo:
                            after = fifo[0]
                            moved = False
                        else:
                            lives[bid] = live
                            after = queue.front()
                    else:
                        after = queue.settle(bid, live)
                    page = entry[PAGE]
                    child = first_child[page]
                    if (
                        child == NO_PAGE  # a leaf, or the page before the last one named in its chain
                        or (child in named and next_sib[child] == NO_PAGE)
                        or not has_unnamed_child(page, links, named)
                    ):
                        named[page] = None
                        entries[page] = None
                        remaining -= 1
                        if deferred:
                            parent = parent_of[page]
                            if parent in deferred and not has_unnamed_child(parent, links, named):
                                undefer = parent
                                halt = True
                    elif not parent_of:  # no tree to follow (a policy used outside a pool): name it, stop
                        named[page] = None
                        entries[page] = None
                        stop = halt = True
                    else:
                        deferred[page] = entry  # back once its descendants are gone
                    if after is None:
                        heappop(heap)
                        break
                    if after[RELEASED] != released:
                        # _base_rank inlined, same arithmetic (the next release time is nearly always new)
                        released = after[RELEASED]
                        age = now - released
                        survive = p * exp(-lam * age)
                        score = alpha * (survive * within / (survive + 1.0 - p))
                        fresh = age <= window
                        if fresh:
                            score += gamma
                        if fresh != second_fresh:
                            limit = math.inf if second_fresh else -math.inf
                        else:
                            limit = second_rank
                    rank = score + beta_level * after[LEVEL]
                    if rank >= limit or remaining <= 0 or halt:
                        if not moved:
                            lives[bid] = live
                        heapreplace(heap, (fresh, rank, released, after[PAGE], after, score))
                        break
                    entry = after
                    if moved:
                        bid = entry[BID]
                        fifo = buckets[bid][entry[LEVEL]]
                        live = lives[bid]
            else:
                if protected:
                    entry = protected.popitem(last=False)[1]
                else:  # the unreachable fallback of _best: the pool evicts the page's subtree with it
                    entry = deferred.pop(next(iter(deferred)))
                    stop = True
                page = entry[PAGE]
                if not stop and has_unnamed_child(page, links, named):
                    if parent_of:
                        deferred[page] = entry
                        continue
                    stop = True  # no tree to follow: name it, stop
                named[page] = None
                entries[page] = None
                remaining -= 1
                if deferred and parent_of:
                    parent = parent_of[page]
                    if parent in deferred and not has_unnamed_child(parent, links, named):
                        undefer = parent
            if undefer != NO_PAGE:
                cands = self._cands = _by_class(heap)
                klass = self._undefer(undefer)
                cands[klass] = self._candidate(queues[klass], now)
                heap = list(cands.values())
                heapify(heap)
        self._cands = _by_class(heap)
        self._count -= len(named)
        return list(named)

    def _expire_protection(self, now: float) -> None:
        """Protection lasts while a page's current score stays in the top share (and inside its class's
        window): a page that was valuable when released but was not reused competes again.

        At most ``_DEMOTE_PER_CALL`` pages are demoted per new ``now``, so that the first burst after
        a long idle spell does not pay for all of them at once (pre-eviction calls this too).
        """
        protected = self._protected
        base_ranks = self._base
        threshold, beta_level = self._top_share.threshold, self.beta_level
        for _ in range(min(_DEMOTE_PER_CALL, len(protected))):
            page = next(iter(protected))
            entry = protected[page]
            klass = entry[KLASS]
            released = entry[RELEASED]
            fresh, score = base_ranks.get((klass, released)) or self._base_rank(klass, released, now)
            if fresh and score + beta_level * entry[LEVEL] >= threshold:
                return  # still in the top share, and so is the rest
            del protected[page]
            self._push(entry)

    def __len__(self) -> int:
        return self._count

    def __contains__(self, page: int) -> bool:
        return 0 <= page < len(self._entry) and self._entry[page] is not None
