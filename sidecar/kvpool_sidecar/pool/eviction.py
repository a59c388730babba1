"""Which pages are evictable and who gets a page: hits taken out of their policies, released pages put
back in, allocation from the free stack, then eviction by each partition's policy.

One path takes victims: :meth:`Eviction._evict_batch` (bulk or one at a time, the leaf fast path
inlined), which hands over to :meth:`Eviction._evict_with_descendants` when a victim has cached
descendants (they go too, leaves first: I4). Owns I5 (a page in use or pinned is in no policy), I7
(a class allocates and evicts only inside its partition, and the other's pages past that one's share or
without a claim), the eviction counters (every evicted
page is counted once, under one reason). Which pages a partition's share protects is :mod:`.claims`'
test; how many pages a partition could get is :mod:`.capacity`'s count, by the rules of
:meth:`Eviction.allocate`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence

from kvpool_sidecar.keys import TO_B, workload_class_of
from kvpool_sidecar.policies import NO_PAGE, EvictionPolicy
from kvpool_sidecar.pool.claims import Claims
from kvpool_sidecar.pool.pages import PageTable
from kvpool_sidecar.pool.records import PARTITIONS, PoolSettings, SeqState


def _one_at_a_time(victim: Callable[[float], int], now: float, count: int, named: list[int]) -> Iterator[int]:
    """Victims of a policy that decides each one in turn, recorded in ``named`` as they are taken."""
    for _ in range(count):
        page = victim(now)
        named.append(page)
        yield page


class Eviction:
    """The partitions' pages and their policies over a :class:`~.pages.PageTable`: who gets which page."""

    def __init__(self, table: PageTable, policies: list[EvictionPolicy], settings: PoolSettings) -> None:
        self.table = table
        self.policies = policies  # one per partition (a handover stands in one during a switch)
        self.owned = [0, 0]  # pages in use or cached, by partition
        self.evictions = 0
        self.evictions_by: dict[tuple[str, str], int] = {}  # (partition, reason) -> pages
        self.claims = Claims(table, self)
        self.configure(settings)

    def configure(self, settings: PoolSettings) -> None:
        self.caps = list(settings.caps)  # each partition's share: its pages in use or pinned stay within it
        self.limits = list(settings.limits)  # the pages each may hold: to-C borrows to-B's idle share
        self.window_of = settings.window_of
        self._windows: dict[Hashable, float] = {}  # by statistics class (a bounded set: keys.MAX_REQUEST_TYPES)
        self.low_watermark = settings.low_watermark

    def partition_of(self, workload_class: str) -> int:
        """The partition a class allocates in (I7): to-B's own while it has a share, else the shared one."""
        return 1 if workload_class == TO_B and self.caps[1] > 0 else 0

    def expired(self, page: int, now: float) -> bool:
        """Whether cached ``page`` waited past its reuse window: the window, as of its release, of
        the class that released it, wherever the page lives (a to-B page in the shared partition
        expires after to-B's window). The one test of "expired": idle eviction takes only such pages,
        and the eviction counters file them under "expired" (the leaf path inlines it)."""
        return self.table.expires[page] < now

    def take_hits(self, hits: list[int], user: str, now: float) -> tuple[int, list[tuple[Hashable, int, float]]]:
        """An admitted prefix's pages are in use again: out of their policies. Returns how many another
        user computed first, and the reuses to tell the reuse model: (class that released them, pages,
        sum of their gaps), by the class that released each."""
        t = self.table
        ref = t.ref
        pins = t.pins
        last = t.last
        policies = self.policies
        part_of = t.part
        klass_of = t.klass
        user_of = t.user
        reused_of = t.reused
        cross_user = 0
        reuses: list[tuple[Hashable, int, float]] = []
        reuse_class: Hashable = None
        reused = 0
        gap_sum = 0.0
        for page in hits:
            if user and user_of[page] and user_of[page] != user:
                cross_user += 1
            if ref[page] == 0:
                # A reuse is evidence about the class that released the page, not the one reusing it.
                klass = klass_of[page]
                if klass != reuse_class:
                    if reused:
                        reuses.append((reuse_class, reused, gap_sum))
                        t.in_use += reused
                    reuse_class, reused, gap_sum = klass, 0, 0.0
                reused += 1
                gap_sum += now - last[page]
                if pins[page] == 0:
                    policies[part_of[page]].take(page, now, True)
            ref[page] += 1
            last[page] = now
            reused_of[page] = 1
        if reused:
            reuses.append((reuse_class, reused, gap_sum))
            t.in_use += reused
        return cross_user, reuses

    def release(self, seq: SeqState, now: float, pinned: int) -> int:
        """A finished sequence's pages: those another sequence holds stay in use, the unpublished ones
        are freed, the rest become evictable in their partition's policy (unless pinned; ``pinned``:
        the pinned pages in all, 0 saves the look). Returns how many stay cached."""
        t = self.table
        ref = t.ref
        key = t.key
        pins = t.pins
        last = t.last
        part = t.part
        policies = self.policies
        owned = self.owned
        free = t.free
        klass = seq.klass
        klass_of = t.klass
        expires = t.expires
        window = self._windows.get(klass)
        if window is None:  # a class's first release since the last (re)configure
            window = self._windows[klass] = self.window_of(workload_class_of(klass))
        expires_at = now + window
        pages = seq.pages
        home = seq.partition
        batch: list[int] = []
        held = 0  # pages another sequence still holds
        freed = 0  # pages never published: freed, not cached
        # Tail first, so that in recency order a prompt's head outlives its tail.
        for page in reversed(pages):
            if ref[page] != 1:
                ref[page] -= 1
                held += 1
                continue
            ref[page] = 0
            last[page] = now
            if key[page] is None:
                owned[part[page]] -= 1
                free.append(page)
                freed += 1
                continue
            klass_of[page] = klass
            expires[page] = expires_at
            if pinned and pins[page]:
                continue
            if part[page] == home:
                batch.append(page)
            else:  # a hit on another partition's page goes back to that partition
                policies[part[page]].insert([page], [pages.index(page)], seq.published, now, klass)
        t.in_use -= len(pages) - held
        if batch:
            # Nearly always the prompt's first pages (its unpublished tail was freed): their depths are
            # a range, known without a lookup.
            depths: Sequence[int]
            if pages[len(batch) - 1] == batch[0]:
                depths = range(len(batch) - 1, -1, -1)
            else:
                depth_of = {page: depth for depth, page in enumerate(pages)}
                depths = [depth_of[page] for page in batch]
            policies[home].insert(batch, depths, seq.published, now, klass)
        return len(pages) - held - freed

    def allocate(self, part: int, count: int, now: float) -> list[int]:
        """Hand out ``count`` pages to ``part``; the caller checked :meth:`.Capacity.obtainable` first.

        Free pages first (in bulk), then evictions; the eviction of a leaf is inlined: it is the hot
        path of a full pool.
        """
        free = self.table.free
        owned = self.owned
        limit = self.limits[part]
        part_of = self.table.part
        ref = self.table.ref
        take = min(count, len(free), max(limit - owned[part], 0))
        if take:
            pages = free[-take:]
            pages.reverse()
            del free[-take:]
            owned[part] += take
        else:
            pages = []
        rest = count - take
        if rest and owned[part] < limit:
            pages += self._reclaim(part, rest, now)
            rest = count - len(pages)
        for page in pages:
            part_of[page] = part
            ref[page] = 1
        if rest:
            pages += self._evict_for(part, rest, now)  # its pages are already ``part``'s, refcount 1
        self.table.in_use += count
        reused = self.table.reused
        for page in pages:
            reused[page] = 0
        return pages

    def _reclaim(self, part: int, want: int, now: float) -> list[int]:
        """Up to ``want`` pages for ``part`` (below its limit) from the other partition, one eviction each
        (a cascade may free several at once): its pages past its share (borrowed, or a live resize shrank
        it) while it has evictable ones, then pages within its share while its next victim holds no
        claim and ``part``'s own does. The rest come from ``part``'s own, as :meth:`.Capacity.obtainable`
        counted them (a page taken here spares one of them)."""
        free = self.table.free
        owned = self.owned
        limit = self.limits[part]
        other = 1 - part
        policy = self.policies[other]
        pages: list[int] = []
        while len(pages) < want and owned[part] < limit:
            if not free:
                if owned[other] > self.caps[other] and len(policy):
                    self._evict_one(other, now, "reclaimed")
                elif self.claims.takes_unclaimed(part, now):
                    self._evict_one(other, now, "unclaimed")
                else:
                    break
            pages.append(free.pop())
            owned[part] += 1
        return pages

    def next_victim(self, part: int, now: float) -> int | None:
        """The page that allocating one page to ``part`` would evict now (as :meth:`allocate` chooses:
        a free page first, then the other partition's past its share or without a claim, then ``part``'s
        own); None when
        it would take a free page or none is evictable."""
        free = self.table.free
        owned = self.owned
        limit = self.limits[part]
        if free and owned[part] < limit:
            return None
        other = 1 - part
        if owned[part] < limit and len(self.policies[other]) and (
            owned[other] > self.caps[other] or self.claims.takes_unclaimed(part, now)
        ):
            return self.policies[other].peek(now)
        policy = self.policies[part]
        return policy.peek(now) if len(policy) else None

    def _evict_for(self, part: int, count: int, now: float) -> list[int]:
        """Evict ``count`` victims of ``part``'s policy and hand them back to ``part`` in use (refcount 1)."""
        pages = self._evict_batch(part, count, now)
        while len(pages) < count:  # a bulk policy may stop early
            more = self._evict_batch(part, count - len(pages), now)
            if not more:  # a broken policy must not hang the request path
                raise RuntimeError(f"eviction policy {self.policies[part].name!r} named no victim")
            pages += more
        return pages

    # hot loop: the leaf fast path of every eviction, inlined (a call per evicted page would show)
    def _evict_batch(self, part: int, count: int, now: float) -> list[int]:
        """Evict up to ``count`` victims of ``part``'s policy (fewer when a bulk policy stops early).

        The loop is the hot path of a full pool: a victim is nearly always a leaf (its descendants
        were released after it, so they went first) and an only child.
        """
        policy = self.policies[part]
        bulk = policy.victims if policy.bulk else None
        ref = self.table.ref
        first_child = self.table.first_child
        parent_of = self.table.parent
        key = self.table.key
        index = self.table.index
        next_sib = self.table.next_sib
        removed = self.table.removed_keys
        expires = self.table.expires
        expired = 0
        pages: list[int]
        batch: Iterable[int]
        if bulk is not None:
            pages = batch = bulk(now, count, (first_child, next_sib))
        else:
            pages = []
            batch = _one_at_a_time(policy.victim, now, count, pages)  # a cascade ends it early
        for page in batch:
            if first_child[page] != NO_PAGE:
                if bulk is not None:
                    evicted = pages.index(page)
                    if evicted + 1 < len(pages):
                        policy.restore(pages[evicted + 1 :])
                else:
                    evicted = len(pages) - 1
                pages = pages[:evicted] + self._evict_with_descendants(part, page, count - evicted, now)
                break
            if expires[page] < now:  # self.expired, inlined
                expired += 1
            k = key[page]
            del index[k]
            key[page] = None
            if removed is not None:
                removed.append(k)
            parent = parent_of[page]
            if parent != NO_PAGE:
                if first_child[parent] == page and next_sib[page] == NO_PAGE:
                    first_child[parent] = NO_PAGE  # an only child; its own stale parent link is
                    # never read: a page gets a parent (or NO_PAGE) when it is published again
                else:
                    self.table.unlink(page)
            ref[page] = 1
        else:
            evicted = len(pages)
        self.evictions += evicted
        if evicted:
            self._count_evictions(part, "expired", expired)
            self._count_evictions(part, "capacity", evicted - expired)
        return pages

    def _evict_with_descendants(self, part: int, page: int, count: int, now: float) -> list[int]:
        """The rest of :meth:`_evict_for` from a victim ``page`` that has cached descendants: they go
        too (I4), and the pages they free are used before the policy is asked for more victims.

        Counts what it evicts; its caller counts none of it.
        """
        policy = self.policies[part]
        free = self.table.free
        owned = self.owned
        # A partition over its share (shrunk by a live resize) keeps its size while it serves its own
        # requests one page for one, as the leaf path does; it must not then fall short of the pages
        # Capacity.obtainable counted (its own evictable ones) because its cascades freed them past its
        # cap.
        cap = max(self.limits[part], owned[part])
        pages: list[int] = []
        expired = victims = 0
        cascaded = [0, 0]  # descendants taken along, by their partition (a hit can cross partitions)
        while True:
            if self.table.first_child[page] != NO_PAGE:
                for p in self._evict_descendants(page):
                    cascaded[self.table.part[p]] += 1
            if self.expired(page, now):
                expired += 1
            self._drop(page)  # freed, then taken back below with the pages its descendants freed
            owned[part] += 1
            pages.append(free.pop())
            victims += 1
            while len(pages) < count and free and owned[part] < cap:
                pages.append(free.pop())
                owned[part] += 1
            if len(pages) >= count:
                break
            page = policy.victim(now)
        for page in pages:  # a cascade may free pages of the other partition
            self.table.part[page] = part
            self.table.ref[page] = 1
        self._count_evictions(part, "expired", expired)
        self._count_evictions(part, "capacity", victims - expired)
        for other, n in enumerate(cascaded):  # evicted to make room, whatever their age
            self._count_evictions(other, "capacity", n)
        return pages

    def _count_evictions(self, part: int, reason: str, pages: int) -> None:
        if pages:
            key = (PARTITIONS[part], reason)
            self.evictions_by[key] = self.evictions_by.get(key, 0) + pages

    def _evict_one(self, part: int, now: float, reason: str) -> int:
        """Evict the policy's victim (and its descendants); returns the pages freed."""
        before = len(self.table.free)
        page = self.policies[part].victim(now)
        if self.table.first_child[page] != NO_PAGE:
            self._evict_descendants(page)
        self._drop(page)
        freed = len(self.table.free) - before
        self._count_evictions(part, reason, freed)
        return freed

    def _evict_descendants(self, page: int) -> list[int]:
        """Descendants of an evicted page are unreachable: evict them too, leaves first (I4); returns them."""
        stack = [page]
        order: list[int] = []
        while stack:
            p = stack.pop()
            child = self.table.first_child[p]
            while child != NO_PAGE:
                order.append(child)
                stack.append(child)
                child = self.table.next_sib[child]
        for p in reversed(order):
            self.policies[self.table.part[p]].evict(p)
            self._drop(p)
        return order

    def _drop(self, page: int) -> None:
        """Remove a cached page (out of its policy already) from the index and the tree and free it."""
        self.owned[self.table.part[page]] -= 1
        self.table.forget(page)
        self.evictions += 1

    def pre_evict(self, now: float, max_pages: int | None = None) -> int:
        """Idle-time eviction: free expired pages, lowest value first, until the free share reaches the
        low watermark, so that a burst finds free pages instead of paying eviction on its request path.

        Only pages past their class's window are taken (a page still inside it may be reused); each
        partition's policy decides which of its pages is least valuable. Returns the pages freed.
        """
        target = self.low_watermark
        if target is None:
            return 0
        budget = self.table.total_pages if max_pages is None else max_pages
        freed = 0
        for part, policy in enumerate(self.policies):
            while len(self.table.free) < target and freed < budget and len(policy):
                if not self.expired(policy.peek(now), now):
                    break  # the least valuable page is still fresh: nothing here is worth freeing
                freed += self._evict_one(part, now, "pre_eviction")
        return freed

    def check(self, free: set[int]) -> None:
        """I5, I7 and the counters, from scratch."""
        owned = [0, 0]
        t = self.table
        for page in range(t.total_pages):
            if page in free:
                continue
            owned[t.part[page]] += 1
            evictable = t.ref[page] == 0 and t.key[page] is not None and t.pins[page] == 0
            in_policy = page in self.policies[t.part[page]]
            assert evictable == in_policy, f"I5: page {page} evictable={evictable} but in_policy={in_policy}"
            assert page not in self.policies[1 - t.part[page]], f"I7: page {page} in the wrong policy"
        assert owned == self.owned, f"I7: partition ownership {self.owned} != {owned}"
        for i, policy in enumerate(self.policies):
            assert len(policy) <= owned[i], "I5: a policy holds more pages than its partition"
            policy.check()
        assert sum(self.evictions_by.values()) == self.evictions, "evictions by reason do not sum to the evictions"
