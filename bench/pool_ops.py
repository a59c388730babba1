"""Page operations per second and Python memory per cached page of the pool (LRU, and the default policy).

    .venv/bin/python bench/pool_ops.py [--trace traces/mooncake_conversation.jsonl.gz]

A page op is one page probed, allocated, cached or freed (the counting used for vLLM's block pool).
Timings on a shared machine swing by 30 %; to compare two versions, count instructions instead:

    PYTHONHASHSEED=0 valgrind --tool=cachegrind --cache-sim=no --cachegrind-out-file=/dev/null \
        .venv/bin/python bench/pool_ops.py --capacity 0.05 --repeat 1 --memory-pages 0

minus the same with ``--repeat 0`` (loading the trace) is the replay's count, exact to 1e-7.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
import tracemalloc
from pathlib import Path

from kvpool_sidecar.config import KVCachePolicySpec
from kvpool_sidecar.pool import PagePool
from kvpool_sidecar.replay import open_trace

TRACE = Path(__file__).resolve().parents[1] / "traces" / "mooncake_conversation.jsonl.gz"
BLOCK = 512


def lru_spec(page_size: int, policy: str = "lru") -> KVCachePolicySpec:
    return KVCachePolicySpec.model_validate(
        {
            "pageSize": page_size,
            "eviction": {"policy": policy},
            "workloads": {"toB": {"isolationPercent": 0}},
            "pinning": {"quotaPercent": 0, "autoPin": {"enabled": False}},
        }
    )


def replay_ops(requests: list[tuple[list[int], int]], pages: int) -> tuple[int, float, float]:
    pool = PagePool(pages, lru_spec(BLOCK), clock=lambda: 0.0)
    ops = 0
    hit_tokens = total_tokens = 0
    gc.disable()
    start = time.perf_counter()
    for i, (ids, n) in enumerate(requests):
        seq = str(i)
        evictions = pool.evictions
        adm = pool.admit(seq, block_hashes=ids, num_tokens=n, now=0.0)
        hits = adm.num_cached_tokens // BLOCK
        full = n // BLOCK
        allocated = len(adm.page_ids) - hits
        published = pool.commit(seq, n) - hits
        pool.release(seq, now=0.0)
        freed = pool.evictions - evictions + (allocated - published)
        ops += hits + (hits < full) + allocated + published + freed
        hit_tokens += adm.num_cached_tokens
        total_tokens += n
    elapsed = time.perf_counter() - start
    gc.enable()
    pool.check_invariants()
    return ops, elapsed, hit_tokens / total_tokens


def bytes_per_cached_page(pages: int = 1_000_000, chain: int = 100, policy: str = "lru") -> float:
    """Everything the pool holds for ``pages`` cached pages of distinct keys: with the self-tuned policy
    that includes its frequency sketch and its shadows, which the distinct keys fill to their caps."""
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    pool = PagePool(pages, lru_spec(16, policy), clock=lambda: 0.0)
    for s in range(pages // chain):
        ids = list(range(s * chain, (s + 1) * chain))
        pool.admit("s", block_hashes=ids, now=0.0)
        pool.commit("s", chain * 16)
        pool.release("s", now=0.0)
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert pool.stats().cached_pages == pages
    return used / pages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--capacity", type=float, action="append", default=None)
    parser.add_argument("--memory-pages", type=int, default=1_000_000, help="0: skip the memory figure")
    parser.add_argument(
        "--repeat", type=int, default=5, help="runs per capacity; the median is reported (0: load the trace only)"
    )
    args = parser.parse_args()
    requests = []
    distinct: set[int] = set()
    with open_trace(args.trace) as fh:
        for line in fh:
            row = json.loads(line)
            requests.append((row["hash_ids"], row["input_length"]))
            distinct.update(row["hash_ids"])
    print(f"trace {args.trace.name}: {len(requests)} requests, {len(distinct)} distinct blocks")
    for frac in args.capacity or [0.05, 0.20]:
        if args.repeat < 1:
            break
        pages = int(len(distinct) * frac)
        runs = [replay_ops(requests, pages) for _ in range(args.repeat)]
        ops, _, ratio = runs[0]
        times = sorted(r[1] for r in runs)
        median = times[len(times) // 2]
        print(
            f"capacity {frac:>5.0%} ({pages} pages): {ops} page ops, median {median:.3f} s = "
            f"{ops / median / 1e6:.2f} M page ops/s (best {ops / times[0] / 1e6:.2f} M), "
            f"token hit ratio {ratio:.4f}"
        )
    if args.memory_pages < 1:
        return
    for policy in ("lru", KVCachePolicySpec().eviction.policy):
        per_page = bytes_per_cached_page(args.memory_pages, policy=policy)
        print(f"memory, {policy}: {per_page:.0f} bytes per cached page ({args.memory_pages} cached pages, tracemalloc)")


if __name__ == "__main__":
    main()
