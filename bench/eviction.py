"""Microseconds per evicted page, per policy, on a 1,000,000-page pool.

    .venv/bin/python bench/eviction.py [--pages 1000000] [--evictions 20000]

The pool is filled with cached chat prefixes of several classes (chains of 64 pages released over
ten minutes of simulated time); then fresh prompts are admitted through the pool's own eviction
path (the policy's choice plus the pool's bookkeeping); each
admission is timed on its own. Each policy's evictions come in rounds alternating with those of an
LRU pool filled alike, and ``x LRU`` is the median of the rounds' ratios: on a shared machine the
medians of two runs a minute apart differ by up to 1.5x, the ratio of alternating rounds holds.
To compare two versions on a noisy machine, count instructions (``valgrind --tool=cachegrind
--cache-sim=no``) of ``--pages 100000 --policy P --alone`` minus the same with ``--evictions 0``
(``--alone``: no LRU pool beside P's, which the count would otherwise include with evictions only).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time

from kvpool_sidecar.config import KVCachePolicySpec
from kvpool_sidecar.policies import POLICIES
from kvpool_sidecar.pool import PagePool, WorkloadMeta

CHAIN = 64
FILL_SECONDS = 600.0  # the fill's span: one to-C window


def filled_pool(policy: str, pages: int, seed: int = 0) -> tuple[PagePool, float, float]:
    spec = KVCachePolicySpec.model_validate(
        {
            "pageSize": 16,
            "eviction": {"policy": policy},
            "workloads": {"toB": {"isolationPercent": 0}},
            "pinning": {"autoPin": {"enabled": False}},
        }
    )
    pool = PagePool(pages, spec, clock=lambda: 0.0)
    rng = random.Random(seed)
    chains = pages // CHAIN
    now = 0.0
    for s in range(chains):
        now = FILL_SECONDS * s / chains
        meta = WorkloadMeta(request_type=rng.choice(["text", "file", "search"]), turn=rng.randrange(6))
        ids = range(s * CHAIN, (s + 1) * CHAIN)
        pool.admit("fill", block_hashes=list(ids), meta=meta, now=now)
        pool.commit("fill", CHAIN * 16, now=now)
        pool.release("fill", now=now)
        if s % 50 == 0:  # some reuse, so that the fits and frequencies have something to learn
            pool.admit("hit", block_hashes=list(range(s * CHAIN, s * CHAIN + 8)), meta=meta, now=now)
            pool.release("hit", now=now)
    step = FILL_SECONDS / chains  # the fill's pace: seconds per admitted chain
    return pool, now, step


def time_evictions(pool: PagePool, now: float, count: int, step: float, fresh: int = 10**9) -> list[float]:
    """Admit fresh 64-page prompts into the full pool: each admission evicts (at least) 64 pages.

    The sample is the admission's time divided by the pages it evicted; the prompt is then committed
    and released, so the pool stays full and the next admission evicts again. Admissions come
    ``step`` seconds apart, the pace of the fill: a steady state, in which pages age out of their
    windows (and out of protection) as fast as they came in. (A faster clock would have every
    admission demote a backlog of expired protected pages that a pool at that pace never has.)
    """
    samples = []
    clock = time.perf_counter_ns
    gc.disable()
    try:
        for i in range(count // CHAIN):
            t = now + step * (i + 1)
            ids = list(range(fresh + i * CHAIN, fresh + (i + 1) * CHAIN))
            before = pool.evictions
            start = clock()
            pool.admit("new", block_hashes=ids, now=t)
            elapsed = clock() - start
            evicted = pool.evictions - before
            pool.commit("new", CHAIN * 16, now=t)  # cached: the pool stays full, the next one evicts
            pool.release("new", now=t)
            if evicted:
                samples.append(elapsed / 1000.0 / evicted)
    finally:
        gc.enable()
    return samples


ROUNDS = 5  # each policy's evictions come in this many rounds, alternating with LRU's


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=1_000_000)
    parser.add_argument("--evictions", type=int, default=20_000, help="0: fill the pool only")
    parser.add_argument("--policy", action="append", choices=sorted(POLICIES))
    parser.add_argument("--alone", action="store_true", help="no LRU rounds beside the policy's (instruction counts)")
    args = parser.parse_args()
    policies = args.policy or [
        "lru", "fifo", "lfu", "s3fifo", "workload_adaptive"
    ]
    print(f"{'policy':<22}{'median us':>10}{'p99 us':>10}{'mean us':>10}{'x LRU':>8}   ({args.pages} pages; "
          f"x LRU: the median of {ROUNDS} rounds' ratios, each policy's rounds alternating with LRU's)")
    for name in policies:
        if args.evictions <= 0:
            pool, _, _ = filled_pool(name, args.pages)
            if args.pages <= 100_000:
                pool.check_invariants()
            del pool
            gc.collect()
            continue
        count = args.evictions
        pair = {policy: list(filled_pool(policy, args.pages))
                for policy in dict.fromkeys([name] if args.alone else ["lru", name])}
        samples: dict[str, list[float]] = {policy: [] for policy in pair}
        ratios = []
        for round_ in range(ROUNDS):
            medians = {}
            for policy, state in pair.items():
                pool, now, step = state
                taken = time_evictions(pool, now, count // ROUNDS, step, fresh=10**9 + round_ * 10**8)
                state[1] = now + step * (count // ROUNDS // CHAIN)
                samples[policy] += taken
                medians[policy] = statistics.median(taken)
            if not args.alone:
                ratios.append(medians[name] / medians["lru"])
        mine = sorted(samples[name])
        p99 = mine[int(len(mine) * 0.99) - 1]
        median, mean = statistics.median(mine), statistics.fmean(mine)
        versus = "-" if args.alone else f"{statistics.median(ratios):.2f}"  # --alone: no LRU to divide by
        print(f"{name:<22}{median:>10.2f}{p99:>10.2f}{mean:>10.2f}{versus:>8}", flush=True)
        if args.pages <= 100_000:
            for pool, _, _ in pair.values():
                pool.check_invariants()
        del pair, pool
        gc.collect()


if __name__ == "__main__":
    main()
