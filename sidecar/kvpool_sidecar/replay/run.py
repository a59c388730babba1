"""Replay a trace through the real pool and policies, and the offline references (Belady, infinite).

Semantics (as in ``traces/README.md``): requests in timestamp order; a request hits the longest
cached prefix of its ids; then its pages are computed and its *full* blocks cached; token hit ratio =
sum(min(hit_blocks * block, input_length)) / sum(input_length).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, NamedTuple

from kvpool_sidecar.config import KVCachePolicySpec
from kvpool_sidecar.pool import TO_B, PagePool, PoolExhausted
from kvpool_sidecar.replay.trace import Request, Trace

REFERENCE_POLICIES = ("belady", "infinite")
Setup = Literal["shipped", "reference"]
SETUPS: tuple[Setup, ...] = ("shipped", "reference")


@dataclass(slots=True)
class ReplayResult:
    policy: str
    capacity_pages: int
    capacity_fraction: float
    token_hit_ratio: float
    block_hit_ratio: float
    requests: int
    evictions: int
    seconds: float
    trace: str = ""
    per_class: dict[str, float] = field(default_factory=dict)
    oversized: int = 0  # requests larger than their partition, run uncached
    pods: int = 1
    routing: str = ""
    load_imbalance: float = 1.0  # max/mean requests per pod
    token_imbalance: float = 1.0  # max/mean prompt tokens per pod
    keys_moved: float | None = None  # share of seen keys whose owner changed at a membership change
    setup: str = "shipped"  # the spec as a user gets it, or the reference setup (see replay_spec)

    def row(self) -> dict[str, Any]:
        return asdict(self)


def token_hits(hit_blocks: int, block_size: int, input_length: int) -> int:
    """The tokens a request's ``hit_blocks`` cached leading blocks spare it (a trailing partial
    block counts its own tokens only)."""
    return min(hit_blocks * block_size, input_length)


def capacity_pages(trace: Trace, capacity: float) -> tuple[int, float]:
    """A capacity of at most 1 is a fraction of the trace's distinct blocks, otherwise a page count."""
    if capacity <= 0:
        raise ValueError("--capacity must be above 0")
    if capacity <= 1:
        return max(1, int(trace.distinct_blocks * capacity)), capacity
    return int(capacity), capacity / trace.distinct_blocks


def replay_spec(
    policy: str, block: int, base: KVCachePolicySpec | None = None, single_class: bool = False,
    setup: Setup = "shipped",
) -> KVCachePolicySpec:
    """The spec a replay runs: the given one (or the shipped defaults) with the policy and page size of
    the trace.

    ``shipped`` runs it as a user gets it (the to-B share, auto-pins). ``reference`` turns auto-pinning
    off and, for a single-class trace, the to-B share, so that every policy gets the same pages and LRU
    replays exactly what the reference simulator does.
    """
    data = (base or KVCachePolicySpec()).model_dump()
    data["pageSize"] = block
    data["eviction"]["policy"] = policy
    if setup == "reference":
        data["pinning"]["autoPin"]["enabled"] = False
        if single_class:
            data["workloads"]["toB"]["isolationPercent"] = 0
    return KVCachePolicySpec.model_validate(data)


def trace_spec(
    trace: Trace, policy: str, base: KVCachePolicySpec | None = None, setup: Setup = "shipped"
) -> KVCachePolicySpec:
    """:func:`replay_spec` for ``trace``: its page size; one partition in the reference setup unless it
    has to-B requests."""
    single_class = not any(r.meta.workload_class == TO_B for r in trace.requests)
    return replay_spec(policy, trace.block_size, base, single_class=single_class, setup=setup)


def replay_pool(
    trace: Trace,
    policy: str,
    capacity: float,
    spec: KVCachePolicySpec | None = None,
    progress: Callable[[int], None] | None = None,
    pool: PagePool | None = None,
    setup: Setup = "shipped",
) -> ReplayResult:
    """Drive the real pool with the trace: admit, commit the whole prompt, release, per request."""
    pages, fraction = capacity_pages(trace, capacity)
    spec = trace_spec(trace, policy, spec, setup)
    pool = pool or PagePool(pages, spec, clock=lambda: 0.0)
    block = trace.block_size
    hit_tokens = hit_blocks = total_blocks = oversized = 0
    class_hits: dict[str, list[int]] = {}
    start = time.perf_counter()
    for i, req in enumerate(trace.requests):
        cached, uncached = serve_request(pool, str(i), req)
        oversized += uncached
        hit_tokens += cached
        hit_blocks += cached // block
        total_blocks += len(req.hash_ids)
        acc = class_hits.setdefault(req.meta.workload_class, [0, 0])
        acc[0] += cached
        acc[1] += req.input_length
        if progress is not None and i % 256 == 255:
            progress(256)
    seconds = time.perf_counter() - start
    total = trace.total_input_tokens()
    return ReplayResult(
        policy, pages, fraction, hit_tokens / total, hit_blocks / total_blocks, len(trace.requests),
        pool.evictions, seconds, trace.name, {k: v[0] / v[1] for k, v in class_hits.items()}, oversized,
        setup=setup,
    )


class Served(NamedTuple):
    """What one replayed request got from the pool."""

    cached: int  # prompt tokens found cached
    oversized: bool  # larger than its whole partition: it ran uncached (its hits still count)


def serve_request(pool: PagePool, seq: str, req: Request) -> Served:
    """One request as an engine runs it: admit, compute and commit the whole prompt, release."""
    now = req.timestamp
    try:
        cached = pool.admit(
            seq, block_hashes=req.hash_ids, num_tokens=req.input_length, meta=req.meta, now=now
        ).num_cached_tokens
    except PoolExhausted:
        return Served(pool.lookup(block_hashes=req.hash_ids, num_tokens=req.input_length, meta=req.meta), True)
    pool.commit(seq, req.input_length, now=now)
    pool.release(seq, now=now)
    return Served(cached, False)


def replay_reference(trace: Trace, policy: str, capacity: float) -> ReplayResult:
    """``infinite`` (no eviction) or ``belady`` (offline optimum: evict the block reused furthest ahead)."""
    if policy == "infinite":
        pages, fraction = trace.distinct_blocks, 1.0
    else:
        pages, fraction = capacity_pages(trace, capacity)
    start = time.perf_counter()
    block = trace.block_size
    reqs = trace.requests
    # next_use[i][j]: index of the next request using block j of request i (len(reqs) = never).
    never = len(reqs)
    next_at: dict[int, int] = {}
    next_use: list[list[int]] = [[]] * len(reqs)
    for i in range(len(reqs) - 1, -1, -1):
        ids = reqs[i].hash_ids
        next_use[i] = [next_at.get(h, never) for h in ids]
        for h in ids:
            next_at[h] = i
    cached: dict[int, int] = {}  # block id -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, block id), lazily deleted
    hit_tokens = hit_blocks = total_blocks = evictions = 0
    for i, req in enumerate(reqs):
        full = req.input_length // block
        ids = req.hash_ids
        hits = 0
        while hits < full and ids[hits] in cached:
            hits += 1
        hit_tokens += token_hits(hits, block, req.input_length)
        hit_blocks += hits
        total_blocks += len(ids)
        current = set(ids[:full])
        for j in range(full):
            h, nxt = ids[j], next_use[i][j]
            if h in cached or len(cached) < pages:
                if h in cached or nxt != never:
                    cached[h] = nxt
                    heapq.heappush(heap, (-nxt, h))
                continue
            if nxt == never:
                continue  # never used again: the oracle does not cache it
            victim = _furthest(heap, cached, current)
            if victim is None or victim[1] <= nxt:
                if victim is not None:
                    heapq.heappush(heap, (-victim[1], victim[0]))
                continue  # everything cached is needed sooner than this block: bypass it
            del cached[victim[0]]
            evictions += 1
            cached[h] = nxt
            heapq.heappush(heap, (-nxt, h))
    total = trace.total_input_tokens()
    return ReplayResult(
        policy, pages, fraction, hit_tokens / total, hit_blocks / total_blocks, len(reqs), evictions,
        time.perf_counter() - start, trace.name,
    )


def _furthest(heap: list[tuple[int, int]], cached: dict[int, int], current: set[int]) -> tuple[int, int] | None:
    """Pop the cached block used furthest ahead that the current request does not hold: (id, next use)."""
    held: list[tuple[int, int]] = []
    found = None
    while heap:
        neg, h = heapq.heappop(heap)
        if cached.get(h) != -neg:
            continue  # stale entry
        if h in current:
            held.append((neg, h))
            continue
        found = (h, -neg)
        break
    for entry in held:
        heapq.heappush(heap, entry)
    return found


def run_matrix(
    trace: Trace,
    policies: list[str],
    capacities: list[float],
    spec: KVCachePolicySpec | None = None,
    progress: Callable[[int], None] | None = None,
    setup: Setup = "shipped",
) -> Iterator[ReplayResult]:
    for capacity in capacities:
        for policy in policies:
            if policy in REFERENCE_POLICIES:
                yield replay_reference(trace, policy, capacity)
            else:
                yield replay_pool(trace, policy, capacity, spec, progress, setup=setup)
