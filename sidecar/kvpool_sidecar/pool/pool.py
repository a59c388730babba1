"""The pool: a fixed set of pages shared by prefix across sequences, with pins and partitions.

:class:`PagePool` is a facade over parts it composes, each with its state and its invariants:
:mod:`.pages` (the page table: I1, I2, I4), :mod:`.eviction` (I5, I7, the counters), :mod:`.pins`
(I6), :mod:`.sequences` (the live sequences, I2's publishing), :mod:`.growth` (their pages taken as
their saves come, admission by evidence), :mod:`.capacity` (what a partition could get: the admission
checks) and :mod:`.frequencies` (page counts and the self-tuners, an observer). The parts read a
:class:`~.records.PoolSettings`, not the spec. The facade holds admission and release, the
all-or-nothing rule (I8: a call that raises leaves the pool as it was) and I9 (no leaks).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from kvpool_sidecar.config import KVCachePolicySpec
from kvpool_sidecar.errors import (
    DuplicateSequence,
    InvalidRequest,
    PoolExhausted,
)
from kvpool_sidecar.keys import (
    DEFAULT_META,
    MAX_REQUEST_TYPES,
    OTHER_REQUEST_TYPES,
    ClassKey,
    WorkloadMeta,
    prompt_keys,
    salted,
    tenant_salt,
    turn_bucket,
)
from kvpool_sidecar.policies import EvictionPolicy, PolicyContext, PolicyFactory, make_policy
from kvpool_sidecar.pool.capacity import Capacity
from kvpool_sidecar.pool.eviction import Eviction
from kvpool_sidecar.pool.frequencies import PageFrequencies
from kvpool_sidecar.pool.growth import Growth
from kvpool_sidecar.pool.handover import Handover
from kvpool_sidecar.pool.pages import PageTable
from kvpool_sidecar.pool.pins import Pinning
from kvpool_sidecar.pool.records import (
    PARTITIONS,
    Admission,
    ForkResult,
    PartitionStats,
    Pin,
    PoolSettings,
    PoolStats,
    SeqState,
)
from kvpool_sidecar.pool.sequences import SequenceTable
from kvpool_sidecar.pool.tuning import SelfTuner
from kvpool_sidecar.workload import ReuseModel

log = logging.getLogger("kvpool.pool")
# Pages a policy switch moves to the new policy per pool call (the rest on later calls and in the
# sidecar's background task): each needs its depth (a walk up the tree), about 0.3 ms per call at a
# prompt depth of 64 pages, so a switch at a million pages stalls nothing.
HANDOVER_PAGES_PER_CALL = 64
# Tenant salts kept computed: callers name tenants (a trusted gateway may name any), so the cache is
# bounded; past it, it starts over (a salt is one keyed hash to recompute).
MAX_CACHED_SALTS = 4096


class PagePool:
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
      (to-C borrows to-B's idle share; to-B reclaims it one eviction per page) or, within it, those that
      hold no claim while its own victim does (:mod:`.claims`); to-B holds at most its share, and to-C's
      pages in use or pinned stay within its own.
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
        settings = PoolSettings.of(spec, total_pages)
        self.page_size = settings.page_size
        self.clock = clock
        self.table = PageTable(total_pages)
        self.eviction = Eviction(self.table, [], settings)
        self.capacity = Capacity(self.table, self.eviction)
        self.frequencies = PageFrequencies(self.eviction, self.capacity)
        self.pinning = Pinning(self.table, self.eviction, settings)
        self.sequences = SequenceTable(self.table, self.eviction, self.capacity, self.pinning, self.page_size,
                                       max_sequences, max_sequence_tokens)
        self.model = ReuseModel(spec)
        self.growth = Growth(self.eviction, self.capacity, self.pinning, self.sequences,
                             self.frequencies, self.page_size)
        self._fixed_factory = policy_factory
        self.eviction.policies[:] = [self._new_policy(spec, i) for i in range(len(PARTITIONS))]
        self._salts: dict[str, bytes] = {}
        self._request_types: set[str] = set()  # those with classes of their own (see class_of)
        # Cumulative counters (read by metrics; cheap ints on the hot path).
        self.hit_tokens = 0
        self.lookup_tokens = 0
        self.observer_errors = 0  # observers (statistics, tuners) that raised; the pool stayed exact
        self._apply(spec, settings)

    def _apply(self, spec: KVCachePolicySpec, settings: PoolSettings) -> None:
        self.settings = settings
        self.eviction.configure(settings)
        self.pinning.configure(settings)
        self.frequencies.configure(settings)
        # eviction.admitByEvidence: a page's claim on its share and the saves' admission rest on the model
        self.eviction.claims.evidence = self.model.evidence if settings.by_evidence else None
        self.spec = spec

    def _new_policy(self, spec: KVCachePolicySpec, part: int) -> EvictionPolicy:
        t = self.table
        ctx = PolicyContext(spec, t.key.__getitem__, PARTITIONS[part], t.tree(), self.frequencies.view(part))
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
        settings = PoolSettings.of(spec, self.total_pages)
        policies = self.eviction.policies
        if spec.eviction.policy != self.spec.eviction.policy and self._fixed_factory is None:
            fresh = [self._new_policy(spec, i) for i in range(len(PARTITIONS))]  # may raise: nothing changed yet
            # The new policy takes the cached pages over a slice per call (see .handover), not all here.
            policies[:] = [Handover(old, new) for old, new in zip(policies, fresh, strict=True)]
        self.model.configure(spec)
        for policy in policies:
            policy.configure(spec)
        self._apply(spec, settings)
        return self.pinning.fit_to_quota(self.clock())

    def _handing_over(self) -> bool:
        policies = self.eviction.policies
        return type(policies[0]) is Handover or type(policies[1]) is Handover

    def _hand_over(self, now: float, budget: int) -> None:
        t = self.table
        policies = self.eviction.policies
        for part, policy in enumerate(policies):
            if isinstance(policy, Handover) and policy.step(now, budget, t.depth, t.last, t.klass):
                policies[part] = policy.new

    def settle(self, now: float | None = None, max_pages: int = HANDOVER_PAGES_PER_CALL) -> bool:
        """A slice of the deferred work (expired pins lapsing, a policy switch's handover), for an idle
        moment or a background task; returns whether some is left."""
        now = self.clock() if now is None else now
        self.pinning.expire(now, max_pages)
        if self._handing_over():
            self._hand_over(now, max_pages)
        return bool(self.pinning.lapsing) or self._handing_over()

    @property
    def policies(self) -> tuple[EvictionPolicy, ...]:
        return tuple(self.eviction.policies)

    def class_of(self, meta: WorkloadMeta) -> ClassKey:
        """The statistics class of a request, less what ``learning.classBy`` leaves out."""
        by_type, by_turn = self.settings.class_by
        request_type = ""
        if by_type:  # callers name request types: the first MAX_REQUEST_TYPES get classes of their own
            request_type = meta.request_type
            if request_type not in self._request_types:
                if len(self._request_types) < MAX_REQUEST_TYPES:
                    self._request_types.add(request_type)
                else:
                    request_type = OTHER_REQUEST_TYPES
        # tuple.__new__: a ClassKey without namedtuple's Python-level __new__ (1 % of an eviction's cost)
        return tuple.__new__(ClassKey, (meta.workload_class, request_type, turn_bucket(meta.turn) if by_turn else 0))

    def _salt(self, tenant: str) -> bytes:
        salt = self._salts.get(tenant)
        if salt is None:
            if len(self._salts) >= MAX_CACHED_SALTS:  # a cache: callers name tenants, salts are recomputable
                self._salts.clear()
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
        if self.sequences.max_sequence_tokens is not None:
            n = len(tokens) if tokens is not None else num_tokens or len(block_hashes or ()) * self.page_size
            self.sequences.check_length(n, "tokens" if tokens is not None else "block_hashes")
        salt = self._salt(meta.tenant) if salted(self.settings.isolate, meta.tenant, tokens is not None) else None
        return prompt_keys(tokens, block_hashes, num_tokens, self.page_size, salt, self.settings.shared_first)

    def cached_pages(self, block_hashes: Sequence[Hashable], meta: WorkloadMeta = DEFAULT_META) -> int:
        """How many leading pages of a prompt with these block hashes are cached now, keyed as
        :meth:`admit` keys them; changes nothing."""
        keys, _ = self._keys(None, block_hashes, len(block_hashes) * self.page_size, meta)
        return len(self.table.cached_prefix(keys))

    def admit(
        self,
        seq_id: str,
        tokens: Sequence[int] | None = None,
        *,
        block_hashes: Sequence[Hashable] | None = None,
        num_tokens: int | None = None,
        meta: WorkloadMeta = DEFAULT_META,
        now: float | None = None,
        allocate: bool = True,
    ) -> Admission:
        """Start a sequence: reuse its longest cached prefix and allocate pages for the rest.

        ``allocate=False``: hold the cached prefix only (the sequence knows all its keys, and counts as
        a lookup of all its tokens); its other pages are taken by :meth:`grow` when their bytes are
        about to be written, so that a request waiting to run holds no page it has not written."""
        now = self.clock() if now is None else now
        pinning, eviction, sequences = self.pinning, self.eviction, self.sequences
        if pinning.due(now):
            pinning.expire(now)
        if self._handing_over():
            self._hand_over(now, HANDOVER_PAGES_PER_CALL)
        if seq_id in sequences.live:
            raise DuplicateSequence(f"sequence {seq_id!r} already exists", "seq_id")
        sequences.room_for_one()
        keys, n = self._keys(tokens, block_hashes, num_tokens, meta)
        ps = self.page_size
        hits = self.table.cached_prefix(keys)
        need = -(-n // ps) - len(hits) if allocate else 0
        part = eviction.partition_of(meta.workload_class)
        if need > 0 and not self.capacity.surely_obtainable(part, need, len(hits)):
            obtainable = self.capacity.obtainable(part, hits)
            if need > obtainable:
                raise PoolExhausted(need, obtainable, PARTITIONS[part])
        # From here on nothing raises (I8): statistics and tuners are observers (see _observe).
        cross_user, reuses = eviction.take_hits(hits, meta.user, now)
        evictions = eviction.evictions
        pages = hits + eviction.allocate(part, need, now) if need > 0 else hits
        cached_tokens = min(len(hits) * ps, n)
        self.hit_tokens += cached_tokens
        self.lookup_tokens += n
        held = n if allocate else len(pages) * ps  # tokens its pages hold room for
        seq = SeqState(seq_id, meta, part, pages, keys, held, n, cached_tokens, len(hits), False,
                       self.class_of(meta))
        sequences.add(seq)
        for klass, reused, gap_sum in reuses:
            self._observe(self.model.observe_reuse, klass, reused, gap_sum, now)
        if self.frequencies.counting:
            before = self._observe(self.frequencies.count, keys, pages, part, meta.workload_class, now)
            if not allocate and before is not None:
                seq.counts = before
        if keys and pinning.autopin.enabled:
            pinning.pin_hot_prefix(keys[0], hits, meta, now)
        return Admission(seq_id, cached_tokens, pages, cross_user * ps, eviction.evictions - evictions, keys)

    def grow(self, seq_id: str, num_tokens: int, now: float | None = None) -> list[int]:
        """Pages for the sequence's keys up to ``num_tokens`` (whole pages) past those it holds, taken now
        (evicting as :meth:`admit` does): as many as its partition can get, maybe none (never raises for
        want of room: a save that finds no page is skipped). Returns the pages added, in key order."""
        return self.growth.grow(seq_id, num_tokens, self.clock() if now is None else now)

    def _observe(self, observer: Callable[..., Any], *args: object) -> Any:
        """Feed an observer of pool events (the reuse model, the sketch, the tuners): it may fail, the
        call that fed it may not. A failure leaves the pool exact (its pages and sequences are recorded
        before any observer runs); it is counted (``observer_errors``) and logged. Returns what the
        observer returned (None when it failed)."""
        try:
            return observer(*args)
        except Exception:
            self.observer_errors += 1
            if self.observer_errors & (self.observer_errors - 1) == 0:  # the 1st, 2nd, 4th, 8th...
                log.exception("an observer of the pool failed (%d so far); the pool is unaffected",
                              self.observer_errors)
            return None

    def release(self, seq_id: str, now: float | None = None) -> None:
        """The sequence is done: its published pages stay cached, the rest are freed."""
        seq = self.sequences.remove(seq_id)
        now = self.clock() if now is None else now
        cached = self.eviction.release(seq, now, self.pinning.pinned_pages)
        if cached:
            # Every cached page, pinned or in the other partition too: each is reported again when it
            # is reused or forgotten, and the model counts those still waiting (at risk).
            self._observe(self.model.observe_release, seq.klass, cached, now)

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
        return min(len(self.table.cached_prefix(keys)) * self.page_size, n)

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
        return keys, self.table.cached_prefix(keys)

    def stats(self) -> PoolStats:
        """Counts kept up to date by every operation: O(1), cheap enough for every scrape."""
        t, ev, seqs = self.table, self.eviction, self.sequences
        in_use = t.in_use
        free = len(t.free)
        parts = {
            name: PartitionStats(ev.caps[i], ev.owned[i], len(ev.policies[i]), self.capacity.borrowed(i))
            for i, name in enumerate(PARTITIONS)
        }
        return PoolStats(
            total_pages=t.total_pages,
            page_size=self.page_size,
            free_pages=free,
            in_use_pages=in_use,
            cached_pages=t.total_pages - free - in_use,
            pinned_pages=self.pinning.pinned_pages,
            pin_quota_pages=self.pinning.quota,
            sequences=len(seqs.live),
            pins=len(self.pinning.records),
            fragmentation_tokens=seqs.alloc_slots - seqs.used_slots,
            unwritten_pages=t.total_pages - free - len(t.index),  # held, not (yet) published
            allocated_token_slots=seqs.alloc_slots,
            evictions=ev.evictions,
            hit_tokens=self.hit_tokens,
            lookup_tokens=self.lookup_tokens,
            partitions=parts,
        )

    def check_invariants(self) -> None:
        """Recompute every invariant from scratch; raises AssertionError naming the one broken."""
        free = self.table.check()
        self.sequences.check()
        self.pinning.check(free)
        self.eviction.check(free)
        if not self.sequences.live:
            cached = sum(1 for k in self.table.key if k is not None)
            assert len(self.table.free) + cached == self.table.total_pages, "I9: pages leaked"

    # The parts' public operations and counters, as the pool's callers know them.

    def pin(
        self,
        tokens: Sequence[int] | None = None,
        *,
        block_hashes: Sequence[Hashable] | None = None,
        seq_id: str | None = None,
        meta: WorkloadMeta = DEFAULT_META,
        ttl: float | None = None,
        now: float | None = None,
    ) -> Pin:
        """Protect a cached prefix (or a sequence's published pages) from eviction; ``ttl`` makes it lapse."""
        now = self.clock() if now is None else now
        self.pinning.expire(now)
        if ttl is not None and ttl <= 0:
            raise InvalidRequest("ttl must be above 0 seconds", "ttl")
        if seq_id is not None:
            if tokens is not None or block_hashes is not None:
                raise InvalidRequest("pin either a seq_id or a prefix, not both", "seq_id")
            seq = self.sequences.get(seq_id)
            pages = seq.pages[: seq.published]
        else:
            keys, _ = self._keys(tokens, block_hashes, None, meta)
            pages = self.table.cached_prefix(keys)
        if not pages:
            raise InvalidRequest("nothing of that prefix is cached to pin", "tokens" if seq_id is None else "seq_id")
        return self.pinning.pin_pages(pages, ttl, now)

    def unpin(self, pin_id: str, now: float | None = None) -> None:
        self.pinning.unpin(pin_id, self.clock() if now is None else now)

    def expire_pins(self, now: float | None = None, max_pages: int | None = None) -> None:
        """Lapse the pins past their TTL now, ``max_pages`` pages at most (None: all); they otherwise
        lapse a slice per pool call."""
        self.pinning.expire(self.clock() if now is None else now, max_pages)

    def commit(self, seq_id: str, num_computed_tokens: int, now: float | None = None) -> int:
        """The KV of the first ``num_computed_tokens`` is written: publish the full pages (I2).

        Returns how many pages the sequence has published in all."""
        return self.sequences.commit(seq_id, num_computed_tokens, self.clock() if now is None else now)

    def append(self, seq_id: str, num_new_tokens: int, now: float | None = None) -> list[int]:
        """Decoding grew the sequence; returns the pages added when it crossed page boundaries."""
        return self.sequences.append(seq_id, num_new_tokens, self.clock() if now is None else now)

    def fork(self, seq_id: str, new_seq_id: str, now: float | None = None) -> ForkResult:
        """Parallel sampling: share the full pages, copy the partial last page into a fresh one."""
        return self.sequences.fork(seq_id, new_seq_id, self.clock() if now is None else now)

    def pre_evict(self, now: float | None = None, max_pages: int | None = None) -> int:
        """Idle-time eviction of expired pages down to the low watermark (:meth:`.Eviction.pre_evict`)."""
        return self.eviction.pre_evict(self.clock() if now is None else now, max_pages)

    def tuners(self) -> dict[str, SelfTuner]:
        return self.frequencies.tuners()

    def tuning(self) -> dict[str, dict]:
        return self.frequencies.tuning()

    @property
    def pins(self) -> dict[str, Pin]:
        return dict(self.pinning.records)

    @property
    def total_pages(self) -> int:
        return self.table.total_pages

    @property
    def removed_keys(self) -> list[Hashable] | None:
        return self.table.removed_keys

    @removed_keys.setter
    def removed_keys(self, keys: list[Hashable] | None) -> None:
        self.table.removed_keys = keys

    @property
    def evictions(self) -> int:
        return self.eviction.evictions

    @property
    def evidence_refused(self) -> int:
        """Pages grows did not take: the victim's evidence outweighed theirs (:mod:`.growth`)."""
        return self.growth.evidence_refused
