"""Issue 19's floor, measured: its recipe replayed as written, beside the pool's LRU and default policy.

    .venv/bin/python bench/recipe_floor.py [--trace T] [--capacity 0.05 ...] [--sample-one-in 1]
        [--ghost 4] [--no-fixed]

The issue gives a recipe as "a floor to beat": evict the page with the smallest
``t_last + S * min(log2(count), 3)``, the count (requests that contained the page) remembered across
evictions by an exact ghost of ``--ghost`` times the capacity, a parent's key never below its
child's, and S chosen online among 0, 2, 8, 30, 60, 120 and 240 s by shadow caches of the same
capacity (hits decayed over 1,000 requests; a switch when one beats the choice in force by more
than 2 %). This is a standalone model of it (exact heaps and dicts, no pool), with the replay
semantics of ``traces/README.md``: S = 0 is LRU, and on a trace without to-B requests
(one partition) its hits equal the pool's LRU's (printed beside it, as the check of the semantics;
the pool splits to-B and to-C traffic into partitions, the model does not). ``--sample-one-in N`` feeds the shadows one
page key in N (by the sketch's hash) at 1/N of the capacity, as kvpool's tuner does.

Prints the token hit ratio of each fixed S, of the tuned recipe and its switches, and of the pool's
LRU and default policy (``workload_adaptive``, self-tuned) on the same trace and capacity.
"""

from __future__ import annotations

import argparse
import heapq
import math
from collections import OrderedDict
from pathlib import Path

from kvpool_sidecar.frequency import mixed_hash
from kvpool_sidecar.replay.run import capacity_pages, replay_pool, token_hits
from kvpool_sidecar.replay.trace import Trace
from policy_matrix import load

CANDIDATES = (0.0, 2.0, 8.0, 30.0, 60.0, 120.0, 240.0)  # the recipe's S, seconds
HORIZON = 1000.0  # requests the shadows' hits decay over
MARGIN = 0.02


class RecipeCache:
    """Page keys ranked by ``t_last + S * min(log2(count), 3)``, counts kept by an exact ghost."""

    def __init__(self, capacity: int, credit_seconds: float, ghost_multiple: float) -> None:
        self.capacity = max(capacity, 1)
        self.credit_seconds = credit_seconds
        self._touched: dict[int, float] = {}  # cached key -> last request time
        self._count: dict[int, int] = {}  # cached key -> requests that contained it
        self._rank: dict[int, float] = {}  # cached key -> its eviction key
        self._heap: list[tuple[float, int, int]] = []  # (rank, serial, key); stale entries skipped
        self._serial = 0
        self._ghost: OrderedDict[int, int] = OrderedDict()  # evicted key -> its count, oldest first
        self._ghost_keys = int(ghost_multiple * self.capacity)

    def _credit(self, count: int) -> float:
        return self.credit_seconds * min(math.log2(count), 3.0)

    def rerank(self, credit_seconds: float) -> None:
        """A new S: every cached key re-ranked (the recipe's switch)."""
        self.credit_seconds = credit_seconds
        self._heap = []
        for key, touched in self._touched.items():
            self._serial += 1
            self._rank[key] = rank = touched + self._credit(self._count[key])
            self._heap.append((rank, self._serial, key))
        heapq.heapify(self._heap)

    def request(self, keys: list[int], full: int, now: float) -> int:
        """One prompt: the leading keys cached (its hit pages), then its ``full`` leading keys
        cached or touched, ranked head first and never above the page before (prefix-closed),
        pushed tail first (a prompt's tail leaves first on equal ranks); then the lowest leave."""
        hits = 0
        for key in keys:
            if key not in self._touched:
                break
            hits += 1
        ranked: list[tuple[float, int]] = []
        ceiling = math.inf
        for key in keys[:full]:
            count = (self._count[key] if key in self._touched else self._ghost.pop(key, 0)) + 1
            self._count[key], self._touched[key] = count, now
            ceiling = min(now + self._credit(count), ceiling)
            self._rank[key] = ceiling
            ranked.append((ceiling, key))
        for rank, key in reversed(ranked):
            self._serial += 1
            heapq.heappush(self._heap, (rank, self._serial, key))
        while len(self._touched) > self.capacity:
            rank, _, key = heapq.heappop(self._heap)
            if self._rank.get(key) != rank:
                continue  # touched since: a later entry stands for it
            del self._touched[key], self._rank[key]
            self._ghost[key] = self._count.pop(key)
            if len(self._ghost) > self._ghost_keys:
                self._ghost.popitem(last=False)
        return hits


def fixed(trace: Trace, pages: int, credit_seconds: float, ghost: float) -> float:
    cache = RecipeCache(pages, credit_seconds, ghost)
    block = trace.block_size
    hit = sum(token_hits(cache.request(r.hash_ids, r.input_length // block, r.timestamp), block, r.input_length)
              for r in trace.requests)
    return hit / sum(r.input_length for r in trace.requests)


def tuned(trace: Trace, pages: int, ghost: float, one_in: int) -> tuple[float, list[tuple[int, float]]]:
    """The recipe's online choice of S; returns its token hit ratio and (request, S) per switch."""
    live = RecipeCache(pages, CANDIDATES[0], ghost)
    shadows = [RecipeCache(pages // one_in, s, ghost) for s in CANDIDATES]
    scores = [0.0] * len(CANDIDATES)
    decay = math.exp(-1.0 / HORIZON)
    current = 0
    switches: list[tuple[int, float]] = []
    hit = 0
    for i, r in enumerate(trace.requests):
        full = r.input_length // trace.block_size
        hit += token_hits(live.request(r.hash_ids, full, r.timestamp), trace.block_size, r.input_length)
        sampled = [k for k in r.hash_ids[:full] if mixed_hash(k) % one_in == 0]
        for j, shadow in enumerate(shadows):
            scores[j] = scores[j] * decay + shadow.request(sampled, len(sampled), r.timestamp)
        best = max(range(len(CANDIDATES)), key=scores.__getitem__)
        if best != current and scores[best] > (1.0 + MARGIN) * scores[current]:
            current = best
            live.rerank(CANDIDATES[current])
            switches.append((i, CANDIDATES[current]))
    return hit / sum(r.input_length for r in trace.requests), switches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default="mooncake_conversation.jsonl.gz",
                        help="a file of traces/, a path, or profile:seed (synth)")
    parser.add_argument("--requests", type=int, default=4000, help="requests of a synth trace")
    parser.add_argument("--capacity", type=float, action="append", help="fraction of distinct blocks (repeatable)")
    parser.add_argument("--sample-one-in", type=int, default=1, help="the shadows' page-key sample")
    parser.add_argument("--ghost", type=float, default=4.0, help="evicted keys remembered, times the capacity")
    parser.add_argument("--no-fixed", action="store_true", help="only the tuned recipe and the pool")
    args = parser.parse_args()
    if args.sample_one_in < 1:
        parser.error("--sample-one-in must be at least 1")
    if args.ghost < 0:
        parser.error("--ghost must be at least 0")
    trace = load(args.trace, args.requests)
    print(f"trace {Path(args.trace).name}; shadows sample 1 in {args.sample_one_in}; ghost {args.ghost:g}x capacity")
    for capacity in args.capacity or [0.02, 0.05, 0.1]:
        pages, fraction = capacity_pages(trace, capacity)
        cells = [] if args.no_fixed else [f"S={s:g}: {fixed(trace, pages, s, args.ghost):.4f}" for s in CANDIDATES]
        ratio, switches = tuned(trace, pages, args.ghost, args.sample_one_in)
        pool_lru = replay_pool(trace, "lru", capacity).token_hit_ratio
        pool_default = replay_pool(trace, "workload_adaptive", capacity).token_hit_ratio
        print(f"{fraction:6.2%} recipe " + "  ".join(cells)
              + f"  tuned: {ratio:.4f} | pool lru {pool_lru:.4f}, workload_adaptive {pool_default:.4f}")
        print("        recipe switches: " + ("; ".join(f"request {i}: S={s:g}" for i, s in switches[:8])
                                            or "none") + (" ..." if len(switches) > 8 else ""), flush=True)


if __name__ == "__main__":
    main()
