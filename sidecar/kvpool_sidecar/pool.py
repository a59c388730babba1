"""The paged KV pool's bookkeeping: pages, the prefix index, pins, partitions. Plain Python, no I/O.

Page state lives in parallel lists indexed by page id (struct of arrays): it is what keeps a
1,000,000-page pool under 300 bytes per cached page and the hot path free of object allocation.

Invariants (checked by :meth:`PagePool.check_invariants`, named here so that code and tests agree):

* I1 one state: every page is exactly one of free (on the free stack), in use (refcount > 0) or
  cached (refcount 0 with a key in the prefix index).
* I2 commit before share: the prefix index only holds full pages whose KV a sequence committed.
* I3 chained keys: a page's key covers its whole prefix; the first page is salted by its tenant
  unless the prefix is declared shared.
* I4 no orphans: the parent of every indexed page is indexed too; eviction takes descendants first.
* I5 eviction safety: a page in use or pinned is never in a policy, so never evicted.
* I6 pin quota: pinned pages never exceed the quota (a lower quota applied live unpins the oldest pins).
* I7 partitions: a class allocates only inside its partition; it evicts only its own pages.
* I8 all or nothing: a call that raises leaves the pool exactly as it was.
* I9 no leaks: with no sequence alive, free + cached pages == total pages.
"""

from __future__ import annotations

import hashlib
import heapq
import secrets
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from kvpool_sidecar.config import KVCachePolicySpec
from kvpool_sidecar.policies import NO_PAGE, EvictionPolicy, PageTree, PolicyContext, PolicyFactory, make_policy
from kvpool_sidecar.workload import DecayedCounter, ReuseModel

TO_C = "toC"
TO_B = "toB"
DEFAULT_TENANT = "default"
# The ghost remembers one evicted key in GHOST_SAMPLE (by the key's hash, so that a reuse is looked
# for on the keys that were remembered) and each stands for GHOST_SAMPLE pages. It keeps a key for as
# long as the longest class window (the model predicts reuse within a window, so it has to see gaps
# that long: at 1 % of the to-C trace a page lives 12 s in the pool, a chat's next turn comes after
# 400 s) and at most GHOST_KEYS_PER_PAGE keys per pool page (memory). A page evicted without its key
# remembered is never reported again: its sampled siblings stand for it, so in expectation eviction
# leaves the model's count of pages waiting for a reuse (at risk) unchanged.
GHOST_SAMPLE = 16
_GHOST_MASK = GHOST_SAMPLE - 1
GHOST_KEYS_PER_PAGE = 1  # a quarter of that lost to-C 1 % (0.1285 against 0.1315)
_GHOST_EXPIRE_PER_CALL = 256  # keys forgotten for age per eviction call (steady state: a few)
_PARTITIONS = (TO_C, TO_B)
PREFIX_RATE_WINDOW = 10.0  # seconds over which a prefix's QPS is measured (auto-pin by QPS)
_MAX_TRACKED_PREFIXES = 65_536  # prefix rates kept before the cold ones are pruned
_TURN_BUCKETS = (0, 1, 2, 3, 3, 5)


# --------------------------------------------------------------------------------------------- errors
class PoolError(Exception):
    """Base of the pool's typed errors; ``field`` names the request field at fault, when one is."""

    status = 400

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(message)
        self.field = field


class InvalidRequest(PoolError):
    status = 422


class UnknownSequence(PoolError):
    status = 404


class UnknownPin(PoolError):
    status = 404


class DuplicateSequence(PoolError):
    status = 409


class QuotaExceeded(PoolError):
    status = 409


class TooManySequences(PoolError):
    """The live-sequence limit is reached (every sequence costs memory, even one that holds no new page)."""

    status = 429


class TooLong(PoolError):
    """A sequence (or a prefix to pin or look up) longer than the pool accepts: hashing it alone costs."""

    status = 413


class PoolExhausted(PoolError):
    status = 503

    def __init__(self, needed: int, evictable: int, partition: str) -> None:
        super().__init__(
            f"partition {partition} needs {needed} pages but only {evictable} are free or evictable"
        )
        self.needed = needed
        self.evictable = evictable
        self.partition = partition


# ------------------------------------------------------------------------------------------ requests
def turn_bucket(turn: int) -> int:
    """Turns 0, 1, 2, 3-4, 5+ (see :attr:`WorkloadMeta.class_key`)."""
    return _TURN_BUCKETS[min(turn, 5)]


@dataclass(frozen=True, slots=True)
class WorkloadMeta:
    """What the engine knows about a request; drives partitioning, salting and the reuse statistics."""

    workload_class: str = TO_C
    request_type: str = "text"
    turn: int = 0
    tenant: str = DEFAULT_TENANT
    user: str = ""

    @property
    def class_key(self) -> tuple[str, str, int]:
        """The statistics class: workload class x request type x turn bucket.

        Turns are bucketed 0, 1, 2, 3-4, 5+: on the Mooncake chat trace the chance that a page is
        reused rises from 0.28 on a first turn to 0.70 from the fifth turn on.
        """
        return (self.workload_class, self.request_type, turn_bucket(self.turn))


DEFAULT_META = WorkloadMeta()


@dataclass(slots=True)  # not frozen: built on every admission, and frozen construction is slow
class Admission:
    seq_id: str
    num_cached_tokens: int
    page_ids: list[int]
    cross_user_tokens: int = 0  # cached tokens first computed for another user
    evicted_pages: int = 0  # pages this admission evicted to make room
    keys: list[Hashable] = field(default_factory=list)  # keys of its full prompt pages


@dataclass(frozen=True, slots=True)
class ForkResult:
    seq_id: str
    page_ids: list[int]
    copy_src: int  # storage copies this page's KV into ``copy_dst`` (NO_PAGE: nothing to copy)
    copy_dst: int


@dataclass(frozen=True, slots=True)
class Pin:
    pin_id: str
    pages: tuple[int, ...]
    expires_at: float | None


@dataclass(slots=True)
class PartitionStats:
    capacity: int
    owned: int  # pages in use or cached that belong to the partition
    evictable: int


@dataclass(slots=True)
class PoolStats:
    total_pages: int
    page_size: int
    free_pages: int
    in_use_pages: int
    cached_pages: int
    pinned_pages: int
    pin_quota_pages: int
    sequences: int
    pins: int
    fragmentation_tokens: int  # token slots allocated to live sequences but not holding a token
    allocated_token_slots: int
    evictions: int
    hit_tokens: int
    lookup_tokens: int
    partitions: dict[str, PartitionStats] = field(default_factory=dict)


@dataclass(slots=True)
class _Seq:
    seq_id: str
    meta: WorkloadMeta
    partition: int
    pages: list[int]
    keys: list[Hashable]  # keys of the full prompt pages
    num_tokens: int
    num_prompt_tokens: int
    num_computed: int = 0
    published: int = 0  # pages [0, published) are in the prefix index
    publish_blocked: bool = False
    klass: Hashable = None  # meta.class_key, computed once


# ---------------------------------------------------------------------------------------- hashing
def tenant_salt(tenant: str) -> bytes:
    return hashlib.blake2b(b"kvpool-tenant\x00" + tenant.encode(), digest_size=16).digest()


def first_page_digest(tokens: Sequence[int], page_size: int) -> str:
    """The unsalted digest of a prompt's first page: what ``tenancy.sharedPrefixes`` lists."""
    buf = array("q", tokens[:page_size]).tobytes()
    return hashlib.blake2b(buf, digest_size=16).hexdigest()


def chain_token_keys(
    tokens: Sequence[int], page_size: int, salt: bytes | None, shared_first: frozenset[str] = frozenset()
) -> list[bytes]:
    """Chained keys of the full pages of ``tokens``: key_i = H(key_{i-1} || tokens of page i).

    The first page is salted with ``salt`` (its tenant) unless ``salt`` is None or its unsalted
    digest is declared shared, so tenants never hit each other's pages.
    """
    try:
        buf = array("q", tokens).tobytes()
    except (TypeError, OverflowError):
        raise InvalidRequest("tokens must be integers in [0, 2**63)", "tokens") from None
    stride = page_size * 8
    keys: list[bytes] = []
    blake = hashlib.blake2b
    parent = b""
    for i in range(len(tokens) // page_size):
        digest = blake(parent + buf[i * stride : (i + 1) * stride], digest_size=16).digest()
        if i == 0 and salt is not None and digest.hex() not in shared_first:
            digest = blake(salt + digest, digest_size=16).digest()
        keys.append(digest)
        parent = digest
    return keys


def salted(isolate: bool, tenant: str, from_tokens: bool) -> bool:
    """Whether a prompt's keys mix in its tenant's salt: token prompts whenever tenants are isolated;
    precomputed block hashes only for a named tenant (trace ids are used as they are)."""
    return isolate and (from_tokens or tenant != DEFAULT_TENANT)


def prompt_keys(
    tokens: Sequence[int] | None,
    block_hashes: Sequence[Hashable] | None,
    num_tokens: int | None,
    page_size: int,
    salt: bytes | None,
    shared_first: frozenset[str] = frozenset(),
) -> tuple[list[Hashable], int]:
    """The keys of a prompt's full pages, and its length in tokens; exactly one of tokens/block_hashes.

    Token prompts are chained (:func:`chain_token_keys`); precomputed block hashes (trace formats,
    engines hashing themselves) are used as they are, or each salted when ``salt`` is given.
    """
    ps = page_size
    if (tokens is None) == (block_hashes is None):
        raise InvalidRequest("give exactly one of tokens or block_hashes", "tokens")
    if tokens is not None:
        if num_tokens is not None and num_tokens != len(tokens):
            raise InvalidRequest("num_tokens must equal len(tokens)", "num_tokens")
        if not tokens:
            raise InvalidRequest("tokens must not be empty", "tokens")
        return chain_token_keys(tokens, ps, salt, shared_first), len(tokens)
    assert block_hashes is not None
    if not block_hashes:
        raise InvalidRequest("block_hashes must not be empty", "block_hashes")
    n = len(block_hashes) * ps if num_tokens is None else num_tokens
    if n < 1 or not (len(block_hashes) - 1) * ps < n <= len(block_hashes) * ps:
        raise InvalidRequest(f"num_tokens={n} does not fit {len(block_hashes)} blocks of {ps} tokens", "num_tokens")
    hashes = block_hashes[: n // ps]
    if salt is None:
        keys = hashes if type(hashes) is list else list(hashes)  # a list's slice is a copy already
    else:
        keys = [hashlib.blake2b(salt + repr(h).encode(), digest_size=16).digest() for h in hashes]
    try:
        hash(tuple(keys))  # hashes every key in C; an unhashable one fails here, before any change
    except TypeError:
        raise InvalidRequest("block_hashes must be integers or strings", "block_hashes") from None
    return keys, n


def _one_at_a_time(victim: Callable[[float], int], now: float, count: int, named: list[int]) -> Iterator[int]:
    """Victims of a policy that decides each one in turn, recorded in ``named`` as they are taken."""
    for _ in range(count):
        page = victim(now)
        named.append(page)
        yield page


# -------------------------------------------------------------------------------------------- pool
class PagePool:
    """A fixed set of ``total_pages`` pages of ``page_size`` tokens, shared by prefix across sequences."""

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
        self.max_sequences = max_sequences
        self.max_sequence_tokens = max_sequence_tokens
        n = total_pages
        self.total_pages = n
        self.page_size = spec.pageSize
        self.clock = clock
        # Page state (struct of arrays).
        self._ref = [0] * n
        self._key: list[Hashable | None] = [None] * n
        self._parent = [NO_PAGE] * n
        self._first_child = [NO_PAGE] * n
        self._next_sib = [NO_PAGE] * n
        self._prev_sib = [NO_PAGE] * n
        self._pins = [0] * n
        self._part = [0] * n
        self._last = [0.0] * n
        self._user: list[str] = [""] * n  # who first computed the page (cross-user reuse)
        self._klass: list[Hashable] = [None] * n  # statistics class of the request that last released it
        self._index: dict[Hashable, int] = {}
        # Keys of recently evicted pages -> (class, last release): a reuse that arrives after eviction
        # is still evidence for the reuse model, which would otherwise only see the reuses that the
        # current policy let survive (and learn its own bias back).
        self._ghost: OrderedDict[Hashable, tuple[Hashable, float]] = OrderedDict()
        self._ghost_cap = 0  # set by _apply: only policies that rank by the model need it
        self.ghost_hits = 0
        self._free = list(range(n - 1, -1, -1))  # a stack: page 0 is handed out first
        self.model = ReuseModel(spec)
        self._fixed_factory = policy_factory
        self._policies: list[EvictionPolicy] = [self._new_policy(spec, i) for i in range(len(_PARTITIONS))]
        self._owned = [0, 0]
        self._caps = [n, 0]
        self._seqs: dict[str, _Seq] = {}
        self._pin_records: dict[str, Pin] = {}
        self._pin_expiry: list[tuple[float, str]] = []
        self._pinned_pages = 0
        self._alloc_slots = 0
        self._used_slots = 0
        self._in_use = 0  # pages with refcount > 0
        self.evictions_by: dict[tuple[str, str], int] = {}  # (partition, reason) -> pages
        self._salts: dict[str, bytes] = {}
        # Cumulative counters (read by metrics; cheap ints on the hot path).
        self.evictions = 0
        self.hit_tokens = 0
        self.lookup_tokens = 0
        self.autopins = 0
        self.autopins_refused = 0
        # First-page key -> recent admissions: a prefix above autoPin.minPrefixQPS keeps its shared
        # pages pinned (the page-length rule's sibling).
        self._prefix_rate = DecayedCounter(PREFIX_RATE_WINDOW)
        self._prune_prefix_rates_at = _MAX_TRACKED_PREFIXES
        self.pre_evictions = 0
        self.spec = spec
        self._apply(spec)

    # --------------------------------------------------------------------------- configuration
    def _apply(self, spec: KVCachePolicySpec) -> None:
        n = self.total_pages
        uses_model = any(getattr(p, "uses_model", False) for p in self._policies)
        self._ghost_cap = max(1, n * GHOST_KEYS_PER_PAGE) if uses_model else 0
        if not self._ghost_cap:
            self._ghost.clear()
        if self.model.track_at_risk and not uses_model:
            self.model.reset_at_risk()  # the ghost that would report them is gone
        self.model.track_at_risk = uses_model  # every page's way out is reported (see release)
        to_b = int(n * spec.workloads.toB.isolationPercent / 100)
        self._caps = [n - to_b, to_b]
        self.pin_quota = int(n * spec.pinning.quotaPercent / 100)
        self._isolate = spec.tenancy.isolation == "perTenant"
        self._shared_first = frozenset(spec.tenancy.sharedPrefixes)
        self._autopin = spec.pinning.autoPin
        self._windows = {TO_C: spec.workloads.toC.window_seconds, TO_B: spec.workloads.toB.window_seconds}
        self._ghost_horizon = max(self._windows.values())
        self._class_by = (("requestType" in spec.learning.classBy), ("turn" in spec.learning.classBy))
        self.spec = spec

    def _new_policy(self, spec: KVCachePolicySpec, part: int) -> EvictionPolicy:
        tree = PageTree(self._parent, self._first_child, self._next_sib)
        ctx = PolicyContext(spec, self.model, self._key.__getitem__, _PARTITIONS[part], tree)
        if self._fixed_factory is not None:
            return self._fixed_factory(ctx)
        return make_policy(spec.eviction.policy, ctx)

    def reconfigure(self, spec: KVCachePolicySpec) -> list[Pin]:
        """Swap parameters on the live pool: no page is dropped; over-full partitions shrink as they evict.

        A new eviction policy takes over the cached pages in their recency order. A quota lowered below
        the pages pinned unpins the oldest pins until the rest fit (I6); returns the pins so removed.
        """
        if spec.pageSize != self.page_size:
            raise InvalidRequest(
                f"pageSize cannot change at runtime ({self.page_size} -> {spec.pageSize}): it needs a restart",
                "pageSize",
            )
        if spec.eviction.policy != self.spec.eviction.policy and self._fixed_factory is None:
            fresh = [self._new_policy(spec, i) for i in range(len(_PARTITIONS))]  # may raise: nothing changed yet
            for part, policy in enumerate(fresh):
                pages = sorted(
                    (p for p in range(self.total_pages) if p in self._policies[part]), key=self._last.__getitem__
                )
                for page in pages:
                    depth = self._depth(page)
                    policy.insert([page], [depth], depth + 1, self._last[page], None)
            self._policies = fresh
        self.model.configure(spec)
        for policy in self._policies:
            policy.configure(spec)
        self._apply(spec)
        return self._fit_pins_to_quota()

    def _fit_pins_to_quota(self) -> list[Pin]:
        dropped: list[Pin] = []
        now = self.clock()
        for record in list(self._pin_records.values()):  # insertion order: oldest first
            if self._pinned_pages <= self.pin_quota:
                break
            self.unpin(record.pin_id, now)
            dropped.append(record)
        return dropped

    @property
    def policies(self) -> tuple[EvictionPolicy, ...]:
        return tuple(self._policies)

    def class_of(self, meta: WorkloadMeta) -> Hashable:
        """The statistics class of a request: ``meta.class_key`` less what ``learning.classBy`` leaves out."""
        by_type, by_turn = self._class_by
        return (
            meta.workload_class,
            meta.request_type if by_type else "",
            turn_bucket(meta.turn) if by_turn else 0,
        )

    def partition_of(self, meta: WorkloadMeta) -> int:
        # With no to-B share there is one shared partition.
        return 1 if meta.workload_class == TO_B and self._caps[1] > 0 else 0

    # ---------------------------------------------------------------------------------- keys
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

    def _cached_prefix(self, keys: list[Hashable]) -> list[int]:
        index = self._index
        hits: list[int] = []
        for key in keys:
            page = index.get(key)
            if page is None:
                break
            hits.append(page)
        return hits

    # ------------------------------------------------------------------------------ allocation
    def _obtainable(self, part: int, exclude: list[int]) -> int:
        """Pages that partition ``part`` could get now, if the pages in ``exclude`` stop being evictable."""
        headroom = self._caps[part] - self._owned[part]
        policies = self._policies
        if not exclude and headroom <= 0:
            return len(policies[part])
        evictable = [len(p) for p in policies]
        ref = self._ref
        pins = self._pins
        part_of = self._part
        for page in exclude:
            if not ref[page] and not pins[page]:  # cached, unpinned: in its policy (I1)
                evictable[part_of[page]] -= 1
        if headroom <= 0:
            return evictable[part]
        return evictable[part] + min(headroom, len(self._free) + evictable[1 - part])

    def _surely_obtainable(self, part: int, need: int, excluded: int) -> bool:
        """Whether ``need`` pages are obtainable by a lower bound of :meth:`_obtainable` that does not
        look at the excluded pages (each makes at most one page of one partition unevictable): enough
        for the admission check of a big pool, and mostly decided by the partition's own pages."""
        own = len(self._policies[part]) - excluded
        if own >= need:
            return True
        headroom = self._caps[part] - self._owned[part]
        if headroom <= 0:
            return False
        other = max(len(self._policies[1 - part]) - excluded, 0)
        return max(own, 0) + min(headroom, len(self._free) + other) >= need

    def _allocate(self, part: int, count: int, now: float) -> list[int]:
        """Hand out ``count`` pages to ``part``; the caller checked :meth:`_obtainable` first.

        Free pages first (in bulk), then evictions; the eviction of a leaf is inlined: it is the hot
        path of a full pool.
        """
        free = self._free
        owned = self._owned
        cap = self._caps[part]
        part_of = self._part
        ref = self._ref
        take = min(count, len(free), max(cap - owned[part], 0))
        if take:
            pages = free[-take:]
            pages.reverse()
            del free[-take:]
            owned[part] += take
        else:
            pages = []
        rest = count - take
        if rest and owned[part] < cap:
            # Under its share with no free page: the other partition is over its share (live resize).
            for _ in range(min(rest, cap - owned[part])):
                self._evict_one(1 - part, now, "capacity")
                pages.append(free.pop())
                owned[part] += 1
            rest = count - len(pages)
        for page in pages:
            part_of[page] = part
            ref[page] = 1
        if rest:
            pages += self._evict_for(part, rest, now)  # its pages are already ``part``'s, refcount 1
        self._in_use += count
        return pages

    def _evict_for(self, part: int, count: int, now: float) -> list[int]:
        """Evict ``count`` victims of ``part``'s policy and hand them back to ``part`` in use (refcount 1)."""
        pages = self._evict_batch(part, count, now)
        while len(pages) < count:  # a bulk policy may stop early
            more = self._evict_batch(part, count - len(pages), now)
            if not more:  # a broken policy must not hang the request path
                raise RuntimeError(f"eviction policy {self._policies[part].name!r} named no victim")
            pages += more
        return pages

    def _evict_batch(self, part: int, count: int, now: float) -> list[int]:
        """Evict up to ``count`` victims of ``part``'s policy (fewer when a bulk policy stops early).

        The loop is the hot path of a full pool: a victim is nearly always a leaf (its descendants
        were released after it, so they went first) and an only child.
        """
        policy = self._policies[part]
        bulk = getattr(policy, "victims", None)
        ref = self._ref
        first_child = self._first_child
        parent_of = self._parent
        key = self._key
        index = self._index
        next_sib = self._next_sib
        last = self._last
        ghost = self._ghost if self._ghost_cap else None
        klass_of = self._klass
        threshold = now - self._windows[_PARTITIONS[part]]
        expired = 0
        # The ghost's value of a key, shared by the keys released together (one tuple, not one each)
        remembered: tuple[Hashable, float] | None = None
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
            if last[page] < threshold:
                expired += 1
            k = key[page]
            del index[k]
            key[page] = None
            if ghost is not None and not hash(k) & _GHOST_MASK:
                if remembered is None or remembered[1] != last[page] or remembered[0] != klass_of[page]:
                    remembered = (klass_of[page], last[page])
                ghost[k] = remembered
            parent = parent_of[page]
            if parent != NO_PAGE:
                if first_child[parent] == page and next_sib[page] == NO_PAGE:
                    first_child[parent] = NO_PAGE  # an only child; its own stale parent link is
                    # never read: a page gets a parent (or NO_PAGE) when it is published again
                else:
                    self._unlink(page)
            ref[page] = 1
        else:
            evicted = len(pages)
        self.evictions += evicted
        if evicted:
            self._count_evictions(part, "expired", expired)
            self._count_evictions(part, "capacity", evicted - expired)
        if ghost:
            self._trim_ghost(now)
        return pages

    def _trim_ghost(self, now: float) -> None:
        """Forget the evicted keys older than the horizon or over the cap, oldest first (mostly none):
        each is a page seen not reused for as long as it was remembered, which the reuse model needs
        as much as the reuses (censored observations)."""
        ghost = self._ghost
        pop = ghost.popitem
        censored: dict[Hashable, list[float]] = {}
        cap = self._ghost_cap
        oldest = now - self._ghost_horizon
        # Keys past the horizon go a bounded number per call: after a long idle spell (or a shorter
        # window) the backlog is spread over the next evictions instead of stalling one request.
        expire = _GHOST_EXPIRE_PER_CALL
        while ghost:
            if len(ghost) <= cap:
                if expire <= 0 or next(iter(ghost.values()))[1] >= oldest:
                    break
                expire -= 1
            klass, released = pop(last=False)[1]
            acc = censored.get(klass)
            if acc is None:
                censored[klass] = [1.0, now - released]
            else:
                acc[0] += 1.0
                acc[1] += now - released
        for klass, (pages, exposure) in censored.items():
            self.model.observe_censored(klass, GHOST_SAMPLE * pages, GHOST_SAMPLE * exposure, now)

    def _evict_with_descendants(self, part: int, page: int, count: int, now: float) -> list[int]:
        """The rest of :meth:`_evict_for` from a victim ``page`` that has cached descendants: they go
        too (I4), and the pages they free are used before the policy is asked for more victims.

        Counts what it evicts; its caller counts none of it.
        """
        policy = self._policies[part]
        window = self._windows[_PARTITIONS[part]]
        free = self._free
        owned = self._owned
        cap = self._caps[part]
        pages: list[int] = []
        expired = victims = 0
        cascaded = [0, 0]  # descendants taken along, by their partition (a hit can cross partitions)
        while True:
            if self._first_child[page] != NO_PAGE:
                for p in self._evict_descendants(page):
                    cascaded[self._part[p]] += 1
            if now - self._last[page] > window:
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
            self._part[page] = part
            self._ref[page] = 1
        self._count_evictions(part, "expired", expired)
        self._count_evictions(part, "capacity", victims - expired)
        for other, n in enumerate(cascaded):  # evicted to make room, whatever their age
            self._count_evictions(other, "capacity", n)
        return pages

    def _count_evictions(self, part: int, reason: str, pages: int) -> None:
        if pages:
            key = (_PARTITIONS[part], reason)
            self.evictions_by[key] = self.evictions_by.get(key, 0) + pages

    def _evict_one(self, part: int, now: float, reason: str) -> int:
        """Evict the policy's victim (and its descendants); returns the pages freed."""
        before = len(self._free)
        page = self._policies[part].victim(now)
        if self._first_child[page] != NO_PAGE:
            self._evict_descendants(page)
        self._drop(page)
        freed = len(self._free) - before
        self._count_evictions(part, reason, freed)
        return freed

    def _evict_descendants(self, page: int) -> list[int]:
        """Descendants of an evicted page are unreachable: evict them too, leaves first (I4); returns them."""
        stack = [page]
        order: list[int] = []
        while stack:
            p = stack.pop()
            child = self._first_child[p]
            while child != NO_PAGE:
                order.append(child)
                stack.append(child)
                child = self._next_sib[child]
        for p in reversed(order):
            self._policies[self._part[p]].evict(p)
            self._drop(p)
        return order

    def _drop(self, page: int) -> None:
        """Remove an evictable page from the index and the tree and free it."""
        k = self._key[page]
        del self._index[k]
        if self._ghost_cap and not hash(k) & _GHOST_MASK:
            self._ghost[k] = (self._klass[page], self._last[page])
        self._key[page] = None
        self._unlink(page)
        self._owned[self._part[page]] -= 1
        self._free.append(page)
        self.evictions += 1

    def _unlink(self, page: int) -> None:
        parent = self._parent[page]
        if parent == NO_PAGE:
            return
        prev, nxt = self._prev_sib[page], self._next_sib[page]
        if prev != NO_PAGE:
            self._next_sib[prev] = nxt
        else:
            self._first_child[parent] = nxt
        if nxt != NO_PAGE:
            self._prev_sib[nxt] = prev
        self._parent[page] = self._prev_sib[page] = self._next_sib[page] = NO_PAGE

    # ------------------------------------------------------------------------------ the API
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
        if self._pin_expiry and self._pin_expiry[0][0] <= now:
            self._expire_pins(now)
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
                raise PoolExhausted(need, obtainable, _PARTITIONS[part])
        # From here on nothing raises (I8).
        ref = self._ref
        pins = self._pins
        last = self._last
        policies = self._policies
        part_of = self._part
        klass_of = self._klass
        user_of = self._user
        user = meta.user
        cross_user = 0
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
                        self.model.observe_reuse(reuse_class, reused, gap_sum, now)
                        self._in_use += reused
                    reuse_class, reused, gap_sum = klass, 0, 0.0
                reused += 1
                gap_sum += now - last[page]
                if pins[page] == 0:
                    policies[part_of[page]].take(page, now, True)
            ref[page] += 1
            last[page] = now
        if reused:
            self.model.observe_reuse(reuse_class, reused, gap_sum, now)
            self._in_use += reused
        ghost = self._ghost
        if ghost:
            late_class: Hashable = None
            late = 0
            late_gaps = 0.0
            for key in keys[len(hits):]:
                if hash(key) & _GHOST_MASK:
                    continue  # not one of the sampled keys: neither seen nor a reason to stop
                seen = ghost.pop(key, None)
                if seen is None:
                    break
                if seen[0] != late_class:
                    if late:
                        self.model.observe_reuse(late_class, late, late_gaps, now)
                    late_class, late, late_gaps = seen[0], 0, 0.0
                late += GHOST_SAMPLE  # each remembered key stands for the unsampled ones
                late_gaps += GHOST_SAMPLE * (now - seen[1])
            if late:
                self.ghost_hits += late
                self.model.observe_reuse(late_class, late, late_gaps, now)
        evictions = self.evictions
        pages = hits + self._allocate(part, need, now) if need > 0 else hits
        cached_tokens = min(len(hits) * ps, n)
        self.hit_tokens += cached_tokens
        self.lookup_tokens += n
        self._seqs[seq_id] = _Seq(seq_id, meta, part, pages, keys, n, n, cached_tokens, len(hits), False,
                                  self.class_of(meta))
        self._alloc_slots += len(pages) * ps
        self._used_slots += n
        if keys and self._autopin.enabled:
            self._pin_hot_prefix(keys[0], hits, meta, now)
        return Admission(seq_id, cached_tokens, pages, cross_user * ps, self.evictions - evictions, keys)

    def _room_for_a_sequence(self) -> None:
        if self.max_sequences is not None and len(self._seqs) >= self.max_sequences:
            raise TooManySequences(
                f"{len(self._seqs)} live sequences: the limit is {self.max_sequences} (--max-sequences); "
                "release finished ones", "seq_id",
            )

    def _check_length(self, num_tokens: int, field: str) -> None:
        if self.max_sequence_tokens is not None and num_tokens > self.max_sequence_tokens:
            raise TooLong(
                f"{num_tokens} tokens: the limit is {self.max_sequence_tokens} per sequence "
                "(--max-sequence-tokens)", field,
            )

    def _seq(self, seq_id: str) -> _Seq:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise UnknownSequence(f"no sequence {seq_id!r}", "seq_id")
        return seq

    def commit(self, seq_id: str, num_computed_tokens: int, now: float | None = None) -> int:
        """The KV of the first ``num_computed_tokens`` is written: publish the full pages (I2).

        Returns how many pages the sequence has published in all.
        """
        seq = self._seq(seq_id)
        if not seq.num_computed <= num_computed_tokens <= seq.num_tokens:
            raise InvalidRequest(
                f"num_computed_tokens must be in [{seq.num_computed}, {seq.num_tokens}]",
                "num_computed_tokens",
            )
        seq.num_computed = num_computed_tokens
        upto = min(num_computed_tokens // self.page_size, len(seq.keys))
        if seq.publish_blocked or upto <= seq.published:
            return seq.published
        index = self._index
        start = seq.published
        new_keys = seq.keys[start:upto]
        if index.keys().isdisjoint(new_keys):
            self._publish_fresh(seq.pages, start, new_keys, seq.meta.user)
            seq.published = upto
        else:
            self._publish_contended(seq, upto)
        if self._autopin.enabled and seq.num_prompt_tokens >= self._autopin.minPromptTokens:
            self._auto_pin(seq, self.clock() if now is None else now)
        return seq.published

    def _publish_fresh(self, pages: list[int], start: int, keys: list[Hashable], user: str) -> None:
        """Index ``pages[start:start + len(keys)]`` under ``keys``, none of which is indexed yet."""
        new_pages = pages[start : start + len(keys)]
        self._index.update(zip(keys, new_pages, strict=True))
        key_of = self._key
        user_of = self._user
        parent_of = self._parent
        first_child = self._first_child
        # The first page may join siblings under a published parent; each later one is the only
        # child of the page before it, which nobody else could reach (it was not indexed).
        parent = pages[start - 1] if start else NO_PAGE
        page = new_pages[0]
        key_of[page] = keys[0]
        user_of[page] = user
        parent_of[page] = parent
        if parent != NO_PAGE:
            head = first_child[parent]
            if head != NO_PAGE:
                self._next_sib[page] = head
                self._prev_sib[head] = page
            first_child[parent] = page
        for i in range(1, len(new_pages)):
            parent = page
            page = new_pages[i]
            key_of[page] = keys[i]
            user_of[page] = user
            parent_of[page] = parent
            first_child[parent] = page

    def _publish_contended(self, seq: _Seq, upto: int) -> None:
        """Publish up to page ``upto`` when some keys are indexed already: by a fork sibling (the
        same page, nothing to do) or by another sequence, which blocks ours from there on."""
        index = self._index
        pages = seq.pages
        for i in range(seq.published, upto):
            page = pages[i]
            holder = index.get(seq.keys[i])
            if holder is None:
                self._publish_fresh(pages, i, [seq.keys[i]], seq.meta.user)
            elif holder != page:
                # Ours stays private (freed on release), and so do the pages after it, whose parent
                # would not be ours.
                seq.publish_blocked = True
                seq.published = i
                return
        seq.published = upto

    def append(self, seq_id: str, num_new_tokens: int, now: float | None = None) -> list[int]:
        """Decoding grew the sequence; returns the pages added when it crossed page boundaries."""
        seq = self._seq(seq_id)
        if num_new_tokens < 0:
            raise InvalidRequest("num_new_tokens must be at least 0", "num_new_tokens")
        self._check_length(seq.num_tokens + num_new_tokens, "num_new_tokens")
        now = self.clock() if now is None else now
        need = -(-(seq.num_tokens + num_new_tokens) // self.page_size) - len(seq.pages)
        if need > 0:
            obtainable = self._obtainable(seq.partition, [])
            if need > obtainable:
                raise PoolExhausted(need, obtainable, _PARTITIONS[seq.partition])
            new = self._allocate(seq.partition, need, now)
            seq.pages.extend(new)
            self._alloc_slots += need * self.page_size
        else:
            new = []
        seq.num_tokens += num_new_tokens
        self._used_slots += num_new_tokens
        return new

    def fork(self, seq_id: str, new_seq_id: str, now: float | None = None) -> ForkResult:
        """Parallel sampling: share the full pages, copy the partial last page into a fresh one."""
        seq = self._seq(seq_id)
        if new_seq_id in self._seqs:
            raise DuplicateSequence(f"sequence {new_seq_id!r} already exists", "new_seq_id")
        self._room_for_a_sequence()
        now = self.clock() if now is None else now
        ps = self.page_size
        full = seq.num_tokens // ps
        partial = len(seq.pages) > full
        if partial:
            obtainable = self._obtainable(seq.partition, [])
            if obtainable < 1:
                raise PoolExhausted(1, obtainable, _PARTITIONS[seq.partition])
        shared = seq.pages[:full]
        for page in shared:
            self._ref[page] += 1
        pages = list(shared)
        src = dst = NO_PAGE
        if partial:
            src = seq.pages[full]
            dst = self._allocate(seq.partition, 1, now)[0]
            pages.append(dst)
        child = _Seq(
            new_seq_id, seq.meta, seq.partition, pages, seq.keys, seq.num_tokens,
            seq.num_prompt_tokens, seq.num_computed, min(seq.published, full), seq.publish_blocked, seq.klass,
        )
        self._seqs[new_seq_id] = child
        self._alloc_slots += len(pages) * ps
        self._used_slots += seq.num_tokens
        return ForkResult(new_seq_id, pages, src, dst)

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
            self.model.observe_release(klass, cached, now)
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

    # --------------------------------------------------------------------------- pre-eviction
    def pre_evict(self, now: float | None = None, max_pages: int | None = None) -> int:
        """Idle-time eviction: free expired pages, lowest value first, until the free share reaches the
        low watermark, so that a burst finds free pages instead of paying eviction on its request path.

        Only pages past their class's window are taken (a page still inside it may be reused); each
        partition's policy decides which of its pages is least valuable. Returns the pages freed.
        """
        if not self.spec.preEviction.enabled:
            return 0
        now = self.clock() if now is None else now
        target = int(self.total_pages * self.spec.preEviction.lowWatermarkPercent / 100)
        budget = self.total_pages if max_pages is None else max_pages
        freed = 0
        for part, policy in enumerate(self._policies):
            while len(self._free) < target and freed < budget and len(policy):
                page = policy.peek(now)
                klass = self._klass[page]
                window = self._windows.get(klass[0] if isinstance(klass, tuple) else TO_C, self._windows[TO_C])
                if now - self._last[page] <= window:
                    break  # the least valuable page is still fresh: nothing here is worth freeing
                n = self._evict_one(part, now, "pre_eviction")
                freed += n
                self.pre_evictions += n
        return freed

    # ---------------------------------------------------------------------------------- pins
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
        self._expire_pins(now)
        if ttl is not None and ttl <= 0:
            raise InvalidRequest("ttl must be above 0 seconds", "ttl")
        if seq_id is not None:
            if tokens is not None or block_hashes is not None:
                raise InvalidRequest("pin either a seq_id or a prefix, not both", "seq_id")
            seq = self._seq(seq_id)
            pages = seq.pages[: seq.published]
        else:
            keys, _ = self._keys(tokens, block_hashes, None, meta)
            pages = self._cached_prefix(keys)
        if not pages:
            raise InvalidRequest("nothing of that prefix is cached to pin", "tokens" if seq_id is None else "seq_id")
        return self._pin_pages(pages, ttl, now)

    def _pin_pages(self, pages: list[int], ttl: float | None, now: float) -> Pin:
        new = sum(1 for p in pages if self._pins[p] == 0)
        if self._pinned_pages + new > self.pin_quota:
            raise QuotaExceeded(
                f"pinning {new} more pages would exceed the pin quota "
                f"({self._pinned_pages} of {self.pin_quota} pages pinned)",
                "pinning.quotaPercent",
            )
        for page in pages:
            if self._pins[page] == 0:
                self._pinned_pages += 1
                if self._ref[page] == 0:
                    self._policies[self._part[page]].take(page, now, False)
            self._pins[page] += 1
        pin_id = f"pin-{secrets.token_hex(12)}"  # unguessable: a pin id is what lets its holder unpin
        expires = None if ttl is None else now + ttl
        record = Pin(pin_id, tuple(pages), expires)
        self._pin_records[pin_id] = record
        if expires is not None:
            heapq.heappush(self._pin_expiry, (expires, pin_id))
        return record

    def unpin(self, pin_id: str, now: float | None = None) -> None:
        record = self._pin_records.pop(pin_id, None)
        if record is None:
            raise UnknownPin(f"no pin {pin_id!r}", "pin_id")
        now = self.clock() if now is None else now
        for page in reversed(record.pages):
            self._pins[page] -= 1
            if self._pins[page] == 0:
                self._pinned_pages -= 1
                if self._ref[page] == 0:
                    depth = self._depth(page)
                    self._policies[self._part[page]].insert([page], [depth], depth + 1, now, None)

    def _depth(self, page: int) -> int:
        depth = 0
        while self._parent[page] != NO_PAGE:
            page = self._parent[page]
            depth += 1
        return depth

    def _expire_pins(self, now: float) -> None:
        expiry = self._pin_expiry
        while expiry and expiry[0][0] <= now:
            _, pin_id = heapq.heappop(expiry)
            if pin_id in self._pin_records:
                self.unpin(pin_id, now)

    def _auto_pin(self, seq: _Seq, now: float) -> None:
        pages = seq.pages[: seq.published]
        if not pages or all(self._pins[p] for p in pages):
            return
        try:
            self._pin_pages(pages, self._windows.get(seq.meta.workload_class, self._windows[TO_C]), now)
            self.autopins += 1
        except QuotaExceeded:
            self.autopins_refused += 1

    def _pin_hot_prefix(self, first_key: Hashable, hits: list[int], meta: WorkloadMeta, now: float) -> None:
        """A prefix admitted more than ``autoPin.minPrefixQPS`` times a second (by its first page) keeps
        the pages this request shared with earlier ones pinned for its class window: what is hot is
        exactly what was reused. A pin past the quota is refused quietly (counted)."""
        rates = self._prefix_rate
        rate = rates.add(first_key, now) / PREFIX_RATE_WINDOW
        if len(rates) > self._prune_prefix_rates_at:
            rates.prune(now, 1.0)  # prefixes seen less than about once a window
            self._prune_prefix_rates_at = max(_MAX_TRACKED_PREFIXES, 2 * len(rates))
        if rate <= self._autopin.minPrefixQPS or not hits or all(self._pins[p] for p in hits):
            return
        try:
            self._pin_pages(hits, self._windows.get(meta.workload_class, self._windows[TO_C]), now)
            self.autopins += 1
        except QuotaExceeded:
            self.autopins_refused += 1

    @property
    def pins(self) -> dict[str, Pin]:
        return dict(self._pin_records)

    def pin_ids(self) -> set[str]:
        """The live pins' ids (those past their TTL are gone once any pin call has run)."""
        return set(self._pin_records)

    # ------------------------------------------------------------------------------- reading
    def sequence_pages(self, seq_id: str) -> list[int]:
        return list(self._seq(seq_id).pages)

    def has_sequence(self, seq_id: str) -> bool:
        return seq_id in self._seqs

    def stats(self) -> PoolStats:
        """Counts kept up to date by every operation: O(1), cheap enough for every scrape."""
        in_use = self._in_use
        free = len(self._free)
        cached = self.total_pages - free - in_use
        parts = {
            name: PartitionStats(self._caps[i], self._owned[i], len(self._policies[i]))
            for i, name in enumerate(_PARTITIONS)
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
        n = self.total_pages
        free_set = set(self._free)
        assert len(free_set) == len(self._free), "I1: a page is on the free stack twice"
        refs = [0] * n
        slots = used = 0
        for seq in self._seqs.values():
            for p in seq.pages:
                refs[p] += 1
            slots += len(seq.pages) * self.page_size
            used += seq.num_tokens
            assert len(seq.pages) == -(-seq.num_tokens // self.page_size), f"{seq.seq_id}: page table size"
            for i in range(seq.published):
                assert self._index.get(seq.keys[i]) == seq.pages[i], f"I2: {seq.seq_id} page {i} unpublished"
            assert seq.published * self.page_size <= seq.num_computed, f"I2: {seq.seq_id} published early"
        assert refs == self._ref, "I1: refcounts differ from the sequences' page tables"
        assert self._in_use == sum(1 for r in refs if r), "in-use page count drifted"
        assert sum(self.evictions_by.values()) == self.evictions, "evictions by reason do not sum to the evictions"
        assert (slots, used) == (self._alloc_slots, self._used_slots), "fragmentation accounting drifted"
        pin_counts = [0] * n
        for record in self._pin_records.values():
            for p in record.pages:
                pin_counts[p] += 1
        assert pin_counts == self._pins, "I6: pin counts differ from the pin records"
        pinned = sum(1 for c in pin_counts if c)
        assert pinned == self._pinned_pages, "I6: pinned page count drifted"
        assert pinned <= self.pin_quota, f"I6: {pinned} pages pinned above the quota of {self.pin_quota}"
        owned = [0, 0]
        for page in range(n):
            key = self._key[page]
            in_free = page in free_set
            states = (in_free, self._ref[page] > 0, self._ref[page] == 0 and key is not None)
            assert sum(states) == 1, f"I1: page {page} is in {sum(states)} states"
            if in_free:
                assert key is None and self._pins[page] == 0, f"I1: free page {page} has a key or a pin"
                continue
            owned[self._part[page]] += 1
            if key is not None:
                assert self._index.get(key) == page, f"I2: index does not map page {page}'s key to it"
                parent = self._parent[page]
                assert parent == NO_PAGE or self._key[parent] is not None, f"I4: page {page} is an orphan"
                if self._pins[page] and parent != NO_PAGE:
                    assert self._pins[parent], f"I6: pinned page {page} has an unpinned parent"
            evictable = self._ref[page] == 0 and key is not None and self._pins[page] == 0
            in_policy = page in self._policies[self._part[page]]
            assert evictable == in_policy, f"I5: page {page} evictable={evictable} but in_policy={in_policy}"
            assert page not in self._policies[1 - self._part[page]], f"I7: page {page} in the wrong policy"
        assert len(self._index) == sum(1 for k in self._key if k is not None), "I2: index size"
        assert owned == self._owned, f"I7: partition ownership {self._owned} != {owned}"
        for i in range(len(_PARTITIONS)):
            assert len(self._policies[i]) <= owned[i], "I5: a policy holds more pages than its partition"
            own_check = getattr(self._policies[i], "check", None)  # a policy's own structure, if it has one
            if own_check is not None:
                own_check()
        for page in range(n):
            child = self._first_child[page]
            while child != NO_PAGE:
                assert self._parent[child] == page, f"I4: tree link of page {child} is broken"
                child = self._next_sib[child]
        if not self._seqs:
            cached = sum(1 for k in self._key if k is not None)
            assert len(self._free) + cached == n, "I9: pages leaked"
