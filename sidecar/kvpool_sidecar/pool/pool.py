"""The pool: a fixed set of pages shared by prefix across sequences, with pins and partitions.

:class:`PagePool` is the facade; each part of it owns its state and its invariants:
:mod:`.pages` (I1, I2, I4), :mod:`.eviction` (I5, I7, the counters), :mod:`.pins` (I6),
:mod:`.frequencies` (page counts and the self-tuner). The facade holds the live sequences
and the all-or-nothing rule (I8: a call that raises leaves the pool as it was) and I9 (no leaks).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Sequence

from kvpool_sidecar.config import KVCachePolicySpec
from kvpool_sidecar.errors import (
    DuplicateSequence,
    InvalidRequest,
    PoolExhausted,
    UnknownSequence,
)
from kvpool_sidecar.keys import (
    DEFAULT_META,
    TO_B,
    ClassKey,
    WorkloadMeta,
    prompt_keys,
    salted,
    tenant_salt,
    turn_bucket,
)
from kvpool_sidecar.policies import EvictionPolicy, PageTree, PolicyContext, PolicyFactory, make_policy
from kvpool_sidecar.pool.eviction import Eviction
from kvpool_sidecar.pool.frequencies import PageFrequencies
from kvpool_sidecar.pool.handover import Handover
from kvpool_sidecar.pool.pages import PageTable
from kvpool_sidecar.pool.pins import Pinning
from kvpool_sidecar.pool.records import PARTITIONS, Admission, PartitionStats, Pin, PoolStats, SeqState
from kvpool_sidecar.pool.sequences import SequenceTable
from kvpool_sidecar.workload import ReuseModel

log = logging.getLogger("kvpool.pool")
# Pages a policy switch moves to the new policy per pool call (the rest on later calls and in the
# sidecar's background task): each needs its depth (a walk up the tree), about 0.3 ms per call at a
# prompt depth of 64 pages, so a switch at a million pages stalls nothing.
HANDOVER_PAGES_PER_CALL = 64


class PagePool(PageTable, SequenceTable, Eviction, Pinning, PageFrequencies):
    """A fixed set of ``total_pages`` pages of ``page_size`` tokens, shared by prefix across sequences.

    Invariants (checked by :meth:`check_invariants`, named so that code and tests agree):

    * I1 one state: every page is exactly one of free (on the free stack), in use (refcount > 0) or
      cached (refcount 0 with a key in the prefix index).
    * I2 commit before share: the prefix index only holds full pages whose KV a sequence committed.
    * I3 chained keys: a page's key covers its whole prefix; the first page is salted by its tenant
      unless the prefix is declared shared (:mod:`kvpool_sidecar.keys`).
    * I4 no orphans: the parent of every indexed page is indexed too; eviction takes descendants first.
    * I5 eviction safety: a page in use or pinned is never in a policy, so never evicted.
    * I6 pin quota: pinned pages never exceed the quota (a lower quota applied live unpins the oldest).
    * I7 partitions: a class evicts only its own pages, and the other's only past that one's share
      (to-C borrows to-B's idle share; to-B reclaims it one eviction per page); to-B holds at most its
      share, and to-C's pages in use or pinned stay within its own.
    * I8 all or nothing: a call that raises leaves the pool exactly as it was.
    * I9 no leaks: with no sequence alive, free + cached pages == total pages.
    """

    def __init__(
        self,
        total_pages: int,
        spec: KVCachePolicySpec | None = None,
        *,
        policy_factory: PolicyFactory | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_sequences: int | None = None,
        max_sequence_tokens: int | None = None,
    ) -> None:
        spec = spec or KVCachePolicySpec()
        if total_pages < 1:
            raise InvalidRequest("total_pages must be at least 1", "total_pages")
        self.page_size = spec.pageSize
        self.clock = clock
        self._init_pages(total_pages)
        self._init_sequences(max_sequences, max_sequence_tokens)
        self._init_eviction()
        self._init_pins(total_pages)
        self._init_frequencies()
        self.model = ReuseModel(spec)
        self._fixed_factory = policy_factory
        self._policies: list[EvictionPolicy] = [self._new_policy(spec, i) for i in range(len(PARTITIONS))]
        self._salts: dict[str, bytes] = {}
        # Cumulative counters (read by metrics; cheap ints on the hot path).
        self.hit_tokens = 0
        self.lookup_tokens = 0
        self.observer_errors = 0  # observers (statistics, tuners) that raised; the pool stayed exact
        self.spec = spec
        self._apply(spec)

    def _apply(self, spec: KVCachePolicySpec) -> None:
        n = self.total_pages
        self._window_of = spec.workloads.window_of
        to_b = int(n * spec.workloads.toB.isolationPercent / 100)
        self._caps = [n - to_b, to_b]
        self._limits = [n, to_b]  # to-B's share is its guarantee and its limit; to-C may borrow its idle pages
        self.pin_quota = int(n * spec.pinning.quotaPercent / 100)
        self._isolate = spec.tenancy.isolation == "perTenant"
        self._shared_first = frozenset(spec.tenancy.sharedPrefixes)
        self._autopin = spec.pinning.autoPin
        self._class_by = (("requestType" in spec.learning.classBy), ("turn" in spec.learning.classBy))
        self._size_frequencies(spec)
        self.spec = spec

    def _new_policy(self, spec: KVCachePolicySpec, part: int) -> EvictionPolicy:
        tree = PageTree(self._parent, self._first_child, self._next_sib)
        ctx = PolicyContext(spec, self._key.__getitem__, PARTITIONS[part], tree, self._frequency_view(part))
        if self._fixed_factory is not None:
            return self._fixed_factory(ctx)
        return make_policy(spec.eviction.policy, ctx)

    def reconfigure(self, spec: KVCachePolicySpec) -> list[Pin]:
        """Swap parameters on the live pool: no page is dropped; over-full partitions shrink as they evict.

        A new eviction policy takes the cached pages over in the old one's eviction order, a slice per
        call (:mod:`.handover`): no call stalls on the whole pool. A quota lowered below
        the pages pinned unpins the oldest pins until the rest fit (I6); returns the pins so removed.
        """
        if spec.pageSize != self.page_size:
            raise InvalidRequest(
                f"pageSize cannot change at runtime ({self.page_size} -> {spec.pageSize}): it needs a restart",
                "pageSize",
            )
        if spec.eviction.policy != self.spec.eviction.policy and self._fixed_factory is None:
            fresh = [self._new_policy(spec, i) for i in range(len(PARTITIONS))]  # may raise: nothing changed yet
            # The new policy takes the cached pages over a slice per call (see .handover), not all here.
            self._policies = [Handover(old, new) for old, new in zip(self._policies, fresh, strict=True)]
        self.model.configure(spec)
        for policy in self._policies:
            policy.configure(spec)
        self._apply(spec)
        return self._fit_pins_to_quota()

    def _handing_over(self) -> bool:
        policies = self._policies
        return type(policies[0]) is Handover or type(policies[1]) is Handover

    def _hand_over(self, now: float, budget: int) -> None:
        for part, policy in enumerate(self._policies):
            if isinstance(policy, Handover) and policy.step(now, budget, self._depth, self._last, self._klass):
                self._policies[part] = policy.new

    def settle(self, now: float | None = None, max_pages: int = HANDOVER_PAGES_PER_CALL) -> bool:
        """A slice of the deferred work (expired pins lapsing, a policy switch's handover), for an idle
        moment or a background task; returns whether some is left."""
        now = self.clock() if now is None else now
        self._expire_pins(now, max_pages)
        if self._handing_over():
            self._hand_over(now, max_pages)
        return bool(self._lapsing) or self._handing_over()

    @property
    def policies(self) -> tuple[EvictionPolicy, ...]:
        return tuple(self._policies)

    def class_of(self, meta: WorkloadMeta) -> ClassKey:
        """The statistics class of a request, less what ``learning.classBy`` leaves out."""
        by_type, by_turn = self._class_by
        # tuple.__new__: a ClassKey without namedtuple's Python-level __new__ (1 % of an eviction's cost)
        return tuple.__new__(ClassKey, (meta.workload_class, meta.request_type if by_type else "",
                                        turn_bucket(meta.turn) if by_turn else 0))

    def _salt(self, tenant: str) -> bytes:
        salt = self._salts.get(tenant)
        if salt is None:
            salt = self._salts[tenant] = tenant_salt(tenant)
        return salt

    def _keys(
        self,
        tokens: Sequence[int] | None,
        block_hashes: Sequence[Hashable] | None,
        num_tokens: int | None,
        meta: WorkloadMeta,
    ) -> tuple[list[Hashable], int]:
        """The keys of the request's full pages, and its length in tokens."""
        if self.max_sequence_tokens is not None:
            n = len(tokens) if tokens is not None else num_tokens or len(block_hashes or ()) * self.page_size
            self._check_length(n, "tokens" if tokens is not None else "block_hashes")
        salt = self._salt(meta.tenant) if salted(self._isolate, meta.tenant, tokens is not None) else None
        return prompt_keys(tokens, block_hashes, num_tokens, self.page_size, salt, self._shared_first)

    def admit(
        self,
        seq_id: str,
        tokens: Sequence[int] | None = None,
        *,
        block_hashes: Sequence[Hashable] | None = None,
        num_tokens: int | None = None,
        meta: WorkloadMeta = DEFAULT_META,
        now: float | None = None,
    ) -> Admission:
        """Start a sequence: reuse its longest cached prefix and allocate pages for the rest."""
        now = self.clock() if now is None else now
        if (self._pin_expiry and self._pin_expiry[0][0] <= now) or self._lapsing:
            self._expire_pins(now)
        if self._handing_over():
            self._hand_over(now, HANDOVER_PAGES_PER_CALL)
        if seq_id in self._seqs:
            raise DuplicateSequence(f"sequence {seq_id!r} already exists", "seq_id")
        self._room_for_a_sequence()
        keys, n = self._keys(tokens, block_hashes, num_tokens, meta)
        ps = self.page_size
        hits = self._cached_prefix(keys)
        need = -(-n // ps) - len(hits)
        part = 1 if meta.workload_class == TO_B and self._caps[1] > 0 else 0  # partition_of, inlined
        if need > 0 and not self._surely_obtainable(part, need, len(hits)):
            obtainable = self._obtainable(part, hits)
            if need > obtainable:
                raise PoolExhausted(need, obtainable, PARTITIONS[part])
        # From here on nothing raises (I8): statistics and tuners are observers (see _observe).
        cross_user, reuses = self._take_hits(hits, meta.user, now)
        evictions = self.evictions
        pages = hits + self._allocate(part, need, now) if need > 0 else hits
        cached_tokens = min(len(hits) * ps, n)
        self.hit_tokens += cached_tokens
        self.lookup_tokens += n
        self._seqs[seq_id] = SeqState(seq_id, meta, part, pages, keys, n, n, cached_tokens, len(hits), False,
                                      self.class_of(meta))
        self._alloc_slots += len(pages) * ps
        self._used_slots += n
        for klass, reused, gap_sum in reuses:
            self._observe(self.model.observe_reuse, klass, reused, gap_sum, now)
        if self._counting:
            self._observe(self._count_pages, keys, pages, part, meta.workload_class, now)
        if keys and self._autopin.enabled:
            self._pin_hot_prefix(keys[0], hits, meta, now)
        return Admission(seq_id, cached_tokens, pages, cross_user * ps, self.evictions - evictions, keys)

    def _observe(self, observer: Callable[..., object], *args: object) -> None:
        """Feed an observer of pool events (the reuse model, the sketch, the tuners): it may fail, the
        call that fed it may not. A failure leaves the pool exact (its pages and sequences are recorded
        before any observer runs); it is counted (``observer_errors``) and logged."""
        try:
            observer(*args)
        except Exception:
            self.observer_errors += 1
            if self.observer_errors & (self.observer_errors - 1) == 0:  # the 1st, 2nd, 4th, 8th...
                log.exception("an observer of the pool failed (%d so far); the pool is unaffected",
                              self.observer_errors)

    def _take_hits(self, hits: list[int], user: str, now: float) -> tuple[int, list[tuple[Hashable, int, float]]]:
        """The admitted prefix's pages are in use again: out of their policies. Returns how many another
        user computed first, and the reuses to tell the model: (class that released them, pages, sum
        of their gaps), by the class that released each."""
        ref = self._ref
        pins = self._pins
        last = self._last
        policies = self._policies
        part_of = self._part
        klass_of = self._klass
        user_of = self._user
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
                        self._in_use += reused
                    reuse_class, reused, gap_sum = klass, 0, 0.0
                reused += 1
                gap_sum += now - last[page]
                if pins[page] == 0:
                    policies[part_of[page]].take(page, now, True)
            ref[page] += 1
            last[page] = now
        if reused:
            reuses.append((reuse_class, reused, gap_sum))
            self._in_use += reused
        return cross_user, reuses

    def release(self, seq_id: str, now: float | None = None) -> None:
        """The sequence is done: its published pages stay cached, the rest are freed."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise UnknownSequence(f"no sequence {seq_id!r}", "seq_id")
        now = self.clock() if now is None else now
        ref = self._ref
        key = self._key
        pins = self._pins
        last = self._last
        part = self._part
        policies = self._policies
        klass = seq.klass
        klass_of = self._klass
        pages = seq.pages
        home = seq.partition
        batch: list[int] = []
        held = 0  # pages another sequence still holds
        freed = 0  # pages never published: freed, not cached
        pinned = self._pinned_pages
        # Tail first, so that in recency order a prompt's head outlives its tail.
        for page in reversed(pages):
            if ref[page] != 1:
                ref[page] -= 1
                held += 1
                continue
            ref[page] = 0
            last[page] = now
            if key[page] is None:
                self._owned[part[page]] -= 1
                self._free.append(page)
                freed += 1
                continue
            klass_of[page] = klass
            if pinned and pins[page]:
                continue
            if part[page] == home:
                batch.append(page)
            else:  # a hit on another partition's page goes back to that partition
                policies[part[page]].insert([page], [pages.index(page)], seq.published, now, klass)
        self._in_use -= len(pages) - held
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
        cached = len(pages) - held - freed
        if cached:
            # Every cached page, pinned or in the other partition too: each is reported again when it
            # is reused or forgotten, and the model counts those still waiting (at risk).
            self._observe(self.model.observe_release, klass, cached, now)
        self._alloc_slots -= len(pages) * self.page_size
        self._used_slots -= seq.num_tokens

    def lookup(
        self,
        tokens: Sequence[int] | None = None,
        *,
        block_hashes: Sequence[Hashable] | None = None,
        num_tokens: int | None = None,
        meta: WorkloadMeta = DEFAULT_META,
    ) -> int:
        """How many leading tokens are cached now; changes nothing."""
        keys, n = self._keys(tokens, block_hashes, num_tokens, meta)
        return min(len(self._cached_prefix(keys)) * self.page_size, n)

    def cached_prefix(
        self,
        tokens: Sequence[int] | None = None,
        *,
        block_hashes: Sequence[Hashable] | None = None,
        num_tokens: int | None = None,
        meta: WorkloadMeta = DEFAULT_META,
    ) -> tuple[list[Hashable], list[int]]:
        """The keys of the prompt's full pages and the ids of its cached leading pages; changes nothing."""
        keys, _ = self._keys(tokens, block_hashes, num_tokens, meta)
        return keys, self._cached_prefix(keys)

    def stats(self) -> PoolStats:
        """Counts kept up to date by every operation: O(1), cheap enough for every scrape."""
        in_use = self._in_use
        free = len(self._free)
        cached = self.total_pages - free - in_use
        parts = {
            name: PartitionStats(self._caps[i], self._owned[i], len(self._policies[i]), self.borrowed(i))
            for i, name in enumerate(PARTITIONS)
        }
        return PoolStats(
            total_pages=self.total_pages,
            page_size=self.page_size,
            free_pages=free,
            in_use_pages=in_use,
            cached_pages=cached,
            pinned_pages=self._pinned_pages,
            pin_quota_pages=self.pin_quota,
            sequences=len(self._seqs),
            pins=len(self._pin_records),
            fragmentation_tokens=self._alloc_slots - self._used_slots,
            allocated_token_slots=self._alloc_slots,
            evictions=self.evictions,
            hit_tokens=self.hit_tokens,
            lookup_tokens=self.lookup_tokens,
            partitions=parts,
        )

    def check_invariants(self) -> None:
        """Recompute every invariant from scratch; raises AssertionError naming the one broken."""
        free = self._check_pages()
        self._check_sequences()
        self._check_pins(free)
        self._check_eviction(free)
        if not self._seqs:
            cached = sum(1 for k in self._key if k is not None)
            assert len(self._free) + cached == self.total_pages, "I9: pages leaked"
