"""The self-tuned workload-aware policy: recency plus a credit for pages that prompts keep containing.

The score is the product's, Score = alpha*P_reuse + beta*S_locality + gamma*T_window, with
``T_window = 1 - age / window`` (a page loses the time term over its class's window) and P_reuse the
probability that a page seen in ``c`` requests is seen in one more (:class:`~kvpool_sidecar.frequency.
ReuseByCount`, counts kept past eviction by the frequency sketch). Ranked at any one time, that score
orders pages exactly as the time-invariant key

    key = released + window / gamma * (alpha * P_reuse(c) + beta * S_locality)

does (:func:`credit_scale`). Pages of one class window and one count share their credit, so they
sit in one FIFO queue (released order: oldest, and a prompt's tail, first), and the next victim is
the lowest of the few queues' heads (a heap of at most ``2 * (COUNT_CAP + 1)`` heads): O(1) in the
pages, exact, and a new weight or curve re-ranks the heads only, so the self-tuner's switch moves
no page. With alpha = 0 the key is the release time and the order is exactly LRU's; the self-tuner
(:mod:`kvpool_sidecar.pool.tuning`) moves alpha among its candidates (LRU among them) by what sampled
shadow caches of the live request stream would have hit.

The order is prefix-closed: a page's count is capped by its parent's (head first over the released
chain, and by the queue of a parent already in the policy), so with P_reuse non-decreasing in the
count a prefix never ranks below a continuation released with it, whatever the weight.
With a locality weight (self-tuning off) the page's locality level joins its queue's identity.
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Sequence
from heapq import heapify, heappop, heappush, heapreplace

from kvpool_sidecar.config import KVCachePolicySpec
from kvpool_sidecar.frequency import COUNT_CAP, FrequencyView, ReuseByCount
from kvpool_sidecar.keys import workload_class_of
from kvpool_sidecar.policies.base import NO_PAGE, PolicyBase, PolicyContext, has_unnamed_child, run_limit

LOCALITY_LEVELS = 16  # S_locality in 1/16ths of a prompt: few queues per class, and enough steps
_LEVELS = COUNT_CAP + 1  # queue ids: (window slot * (LOCALITY_LEVELS + 1) + level) * _LEVELS + count


def locality_level(depth: int, length: int) -> int:
    """S_locality in 1/16ths: a prompt's first page is 16, its last 1 or more. Relative to its prompt,
    because what is worth keeping of a prompt is its head (system prompt, history); the tails of all
    prompts compete on their reuse credit alone."""
    if depth >= length:
        return 1
    return LOCALITY_LEVELS - (depth * LOCALITY_LEVELS) // length


def credit_scale(weight: float, window: float, gamma: float) -> float:
    """Seconds of key per unit of a score term of ``weight``: how far ahead of its release time a
    page with that term at 1 ranks (see the module's notes; gamma is the time term's weight)."""
    return weight * window / gamma


class WorkloadAdaptivePolicy(PolicyBase):
    name = "workload_adaptive"
    bulk = True
    uses_frequency = True

    def __init__(self, ctx: PolicyContext) -> None:
        view = ctx.frequency
        self._view = view if view is not None else FrequencyView([], ReuseByCount())
        self.partition = ctx.partition
        tree = ctx.tree
        self._parent: Sequence[int] = tree.parent if tree is not None else ()
        # Per page (grown to the page ids seen): its queue (-1: not in the policy), its links within
        # the queue, its release time and its insertion stamp (ties of key go to the older page).
        self._qid: list[int] = []
        self._prev: list[int] = []
        self._next: list[int] = []
        self._released = array("d")
        self._stamp = array("q")
        self._serial = 0
        self._head: dict[int, int] = {}
        self._tail: dict[int, int] = {}
        self._heap: list[tuple[float, int, int]] = []  # (key of a queue's head, its stamp, queue id)
        self._len = 0
        self._slot_classes: list[str] = []  # the workload classes, in slot order
        self._window_slot: dict[Hashable, int] = {}
        self._credit: list[float] = []  # per queue id: its credit in seconds (filled by _rerank)
        self._curve_p: list[float] = []  # the curve the credits were computed with
        self.tuned_weight: float | None = None  # set by the self-tuner; None: the configured alpha
        self.configure(ctx.spec)

    # ------------------------------------------------------------------------------ parameters
    def configure(self, spec: KVCachePolicySpec) -> None:
        w = spec.eviction.weights
        self._configured = (w.reuse, w.locality)
        self.gamma = w.timeWindow if w.timeWindow > 0 else 1.0  # no time term: credits in windows
        self._workloads = spec.workloads
        self._rerank()

    def set_reuse_weight(self, weight: float | None) -> None:
        """The self-tuner's alpha (with beta 0: its candidates are ranked on reuse alone); None
        restores the configured weights. Re-ranks the queues' heads; no page moves."""
        self.tuned_weight = weight
        self._rerank()

    @property
    def weights(self) -> tuple[float, float]:
        """(alpha, beta) in force."""
        return self._configured if self.tuned_weight is None else (self.tuned_weight, 0.0)

    def _rerank(self) -> None:
        """Credits per queue from the weights, windows and curve in force, and the heads' heap."""
        alpha, beta = self.weights
        p = self._view.curve.p
        self._curve_p = p
        credit: list[float] = []
        for workload in self._slot_classes:
            window = self._workloads.window_of(workload)
            reuse = credit_scale(alpha, window, self.gamma)
            per_level = credit_scale(beta, window, self.gamma) / LOCALITY_LEVELS
            for level in range(LOCALITY_LEVELS + 1):
                credit.extend(reuse * p[c] + per_level * level for c in range(_LEVELS))
        self._credit = credit
        released, stamp = self._released, self._stamp
        self._heap = [(released[h] + credit[q], stamp[h], q) for q, h in self._head.items()]
        heapify(self._heap)

    def _slot(self, klass: Hashable) -> int:
        """The queue slot of a statistics class: one per workload class, whose window the credits
        are re-read from at each re-rank (a reloaded window applies to the pages already queued)."""
        slot = self._window_slot.get(klass)
        if slot is None:
            workload = workload_class_of(klass)
            if workload not in self._slot_classes:
                self._slot_classes.append(workload)
                self._rerank()
            slot = self._window_slot[klass] = self._slot_classes.index(workload)
        return slot

    # ---------------------------------------------------------------------------- membership
    def _grow(self, top: int) -> None:
        more = top + 1 - len(self._qid)
        if more > 0:
            self._qid.extend([-1] * more)
            self._prev.extend([NO_PAGE] * more)
            self._next.extend([NO_PAGE] * more)
            self._released.extend([0.0] * more)
            self._stamp.extend([0] * more)

    def insert(self, pages: list[int], depths: Sequence[int], length: int, now: float, klass: Hashable) -> None:
        """Queue each page by its count (head first, capped by its parent's), tails first."""
        self._grow(max(pages))
        if self._view.curve.p is not self._curve_p:
            self._rerank()  # the curve was refitted: the heads' keys changed
        base = self._slot(klass) * (LOCALITY_LEVELS + 1) * _LEVELS
        page_counts = self._view.page_counts
        counted = len(page_counts)
        by_level = self.weights[1] > 0
        qid_of = self._qid
        parent = self._parent[pages[-1]] if self._parent else NO_PAGE
        cap = COUNT_CAP
        if parent != NO_PAGE and parent < len(qid_of) and qid_of[parent] >= 0:
            cap = qid_of[parent] % _LEVELS
        qids: list[int] = []
        for i in range(len(pages) - 1, -1, -1):  # head first
            page = pages[i]
            count = page_counts[page] if page < counted else 0
            if count > cap:
                count = cap
            cap = count
            level = locality_level(depths[i], length) if by_level else 0
            qids.append(base + level * _LEVELS + count)
        qids.reverse()
        self._link_runs(pages, qids, now)
        self._len += len(pages)

    # hot loop: every released page is linked here (runs of one queue at a time, a call per run)
    def _link_runs(self, pages: list[int], qids: list[int], now: float) -> None:
        """Append ``pages`` to their queues, in order (a released chain's queue ids come in runs)."""
        head, tail, nxt, prev = self._head, self._tail, self._next, self._prev
        qid_of, released, stamp = self._qid, self._released, self._stamp
        serial = self._serial
        n = len(pages)
        i = 0
        while i < n:
            qid = qids[i]
            end = i + 1
            while end < n and qids[end] == qid:
                end += 1
            last = tail.get(qid, NO_PAGE)
            first = pages[i]
            for k in range(i, end):
                page = pages[k]
                serial += 1
                qid_of[page] = qid
                released[page] = now
                stamp[page] = serial
                prev[page] = last
                if last != NO_PAGE:
                    nxt[last] = page
                last = page
            nxt[last] = NO_PAGE
            tail[qid] = last
            if qid not in head:
                head[qid] = first
                heappush(self._heap, (now + self._credit[qid], stamp[first], qid))
            i = end
        self._serial = serial

    def take(self, page: int, now: float, hit: bool) -> None:
        qid = self._qid[page]
        before, after = self._prev[page], self._next[page]
        if before == NO_PAGE:
            if after == NO_PAGE:
                del self._head[qid], self._tail[qid]
            else:
                self._head[qid] = after
                self._prev[after] = NO_PAGE
                heappush(self._heap, (self._released[after] + self._credit[qid], self._stamp[after], qid))
        else:
            self._next[before] = after
            if after == NO_PAGE:
                self._tail[qid] = before
            else:
                self._prev[after] = before
        self._qid[page] = -1
        self._len -= 1
        if len(self._heap) > 4 * len(self._head) + 64:  # heads replaced by takes: drop their entries
            self._rerank()

    def evict(self, page: int) -> None:
        self.take(page, 0.0, False)

    # ------------------------------------------------------------------------------- victims
    def _lowest(self) -> int:
        """The head of the queue with the lowest head key (dropping the entries of replaced heads)."""
        heap, head, stamp = self._heap, self._head, self._stamp
        while True:
            _, top_stamp, qid = heap[0]
            page = head.get(qid, NO_PAGE)
            if page != NO_PAGE and stamp[page] == top_stamp:
                return page
            heappop(heap)

    def peek(self, now: float) -> int:
        if not self._len:
            raise LookupError("no evictable page")
        return self._lowest()

    def victim(self, now: float) -> int:
        page = self._lowest()
        self.take(page, now, False)
        return page

    # hot loop: one pass names an admission's victims (a call per page would show)
    def victims(self, now: float, count: int, links: tuple[Sequence[int], Sequence[int]]) -> list[int]:
        """The ``count`` lowest pages, stopping right after one with a cached child not named.

        Takes a run from the lowest queue while its pages stay below every other queue's head (the
        heap's second entry bounds them), so the heap is touched once per run, not per page.
        """
        first_child, next_sib = links
        heap, head, tail = self._heap, self._head, self._tail
        nxt, prev, qid_of = self._next, self._prev, self._qid
        released, stamp, credit = self._released, self._stamp, self._credit
        named: list[int] = []
        # The stop rule's test is inlined for the common case, a parent right after its only child
        # (a chain's tail leaves first); otherwise it asks the set of the pages named so far.
        seen: set[int] = set()
        synced = 0  # named[:synced] are in seen
        before = NO_PAGE  # the page named last
        stop = False
        while len(named) < count and not stop:
            _, top_stamp, qid = heap[0]
            page = head.get(qid, NO_PAGE)
            if page == NO_PAGE or stamp[page] != top_stamp:
                heappop(heap)
                continue
            limit = run_limit(heap)
            gain = credit[qid]
            while True:
                after = nxt[page]
                qid_of[page] = -1
                named.append(page)
                child = first_child[page]
                if child != NO_PAGE and (child != before or next_sib[child] != NO_PAGE):
                    seen.update(named[synced:])
                    synced = len(named)
                    if has_unnamed_child(page, links, seen):
                        stop = True
                        break
                before = page
                if after == NO_PAGE or len(named) >= count or released[after] + gain >= limit:
                    break
                page = after
            if after == NO_PAGE:
                del head[qid], tail[qid]
                heappop(heap)
            else:
                head[qid] = after
                prev[after] = NO_PAGE
                heapreplace(heap, (released[after] + gain, stamp[after], qid))
        self._len -= len(named)
        return named

    def check(self) -> None:
        """Each queue links back and forth in stamp order, every page in it carries its id, each
        head has its heap entry, and the queues hold ``len(self)`` pages."""
        total = 0
        entries = {(stamp, qid) for _, stamp, qid in self._heap}
        for qid, page in self._head.items():
            assert (self._stamp[page], qid) in entries, f"adaptive: queue {qid}'s head has no heap entry"
            before = NO_PAGE
            while page != NO_PAGE:
                assert self._qid[page] == qid, f"adaptive: page {page} in queue {qid} says {self._qid[page]}"
                assert self._prev[page] == before, f"adaptive: page {page} links back to {self._prev[page]}"
                if before != NO_PAGE:
                    assert self._stamp[before] < self._stamp[page], f"adaptive: queue {qid} out of order"
                before, page = page, self._next[page]
                total += 1
                assert total <= self._len, "adaptive: more pages linked than counted"
            assert self._tail[qid] == before, f"adaptive: queue {qid}'s tail is not its last page"
        assert total == self._len, f"adaptive: {total} pages linked, {self._len} counted"
        assert len(self._tail) == len(self._head), "adaptive: queues with a head and no tail"

    def __len__(self) -> int:
        return self._len

    def __contains__(self, page: int) -> bool:
        return 0 <= page < len(self._qid) and self._qid[page] >= 0
