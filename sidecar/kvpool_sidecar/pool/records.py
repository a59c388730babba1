"""The records the pool hands out and keeps: admissions, forks, pins, stats, live sequences, and the
settings its parts read (built from the spec, so that no part reads the spec itself)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from kvpool_sidecar.config import AutoPin, KVCachePolicySpec, SelfTuning
from kvpool_sidecar.keys import TO_B, TO_C, WorkloadMeta

PARTITIONS = (TO_C, TO_B)  # partition 0 is shared; partition 1, when sized, is to-B's own


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
    auto: bool = False  # the pool's own (a long prompt, a hot prefix): yields to newer pins


@dataclass(slots=True)
class PartitionStats:
    capacity: int
    owned: int  # pages in use or cached that belong to the partition
    evictable: int
    borrowed: int = 0  # pages past its share: the other partition's idle pages, given back on demand


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
    unwritten_pages: int  # pages live sequences hold that are not published: their bytes not (yet) committed
    allocated_token_slots: int
    evictions: int
    hit_tokens: int
    lookup_tokens: int
    partitions: dict[str, PartitionStats] = field(default_factory=dict)


@dataclass(slots=True)
class SeqState:
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
    klass: Hashable = None  # its statistics class (PagePool.class_of), computed once
    autopin: str | None = None  # its auto-pin's id: one record, grown by its chunked commits
    counts: list[int] | None = None  # admitted with pages to come (PagePool.grow): its keys' counts then


@dataclass(frozen=True, slots=True)
class PoolSettings:
    """What the pool's parts read of a :class:`~kvpool_sidecar.config.KVCachePolicySpec`, for ``n`` pages."""

    page_size: int
    window_of: Callable[[str], float]  # a workload class's reuse window, in seconds
    caps: tuple[int, int]  # each partition's share: its pages in use or pinned stay within it
    limits: tuple[int, int]  # the pages each may hold: to-C borrows to-B's idle share
    pin_quota: int
    autopin: AutoPin
    low_watermark: int | None  # free pages idle eviction keeps; None: off
    tuning: SelfTuning
    gamma: float  # the time window's weight, which the self-tuner's shadows rank by too
    isolate: bool  # per-tenant keys
    shared_first: frozenset[str]  # first pages every tenant shares
    class_by: tuple[bool, bool]  # statistics classes by request type, by turn
    by_evidence: bool  # eviction.admitByEvidence (PagePool.grow)

    @classmethod
    def of(cls, spec: KVCachePolicySpec, n: int) -> PoolSettings:
        to_b = int(n * spec.workloads.toB.isolationPercent / 100)
        pre = spec.preEviction
        return cls(
            page_size=spec.pageSize,
            window_of=spec.workloads.window_of,
            caps=(n - to_b, to_b),
            limits=(n, to_b),  # to-B's share is its guarantee and its limit
            pin_quota=int(n * spec.pinning.quotaPercent / 100),
            autopin=spec.pinning.autoPin,
            low_watermark=int(n * pre.lowWatermarkPercent / 100) if pre.enabled else None,
            tuning=spec.eviction.selfTuning,
            gamma=spec.eviction.weights.timeWindow or 1.0,
            isolate=spec.tenancy.isolation == "perTenant",
            shared_first=frozenset(spec.tenancy.sharedPrefixes),
            class_by=("requestType" in spec.learning.classBy, "turn" in spec.learning.classBy),
            by_evidence=spec.eviction.admitByEvidence,
        )
