"""Replay time of the default policy (self-tuning and its shadows included) against LRU's, in one run.

    .venv/bin/python bench/replay_time.py [--capacity 0.05 --capacity 0.2] [--repeat 3] [--instructions]

Replays the conversation trace through the real pool with each policy, alternating the two, and prints
the median seconds of each and their ratio (the issue-19 bound: at most 3x LRU's). Timings on a shared
machine swing by 0.5x of the ratio from run to run; ``--instructions`` counts instructions instead
(cachegrind, a replay minus a run that only loads the trace), which repeat to about 1e-5 within one run.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from instructions import ROOT, instructions
from kvpool_sidecar.config import KVCachePolicySpec
from kvpool_sidecar.replay import read_trace, replay_pool

TRACE = ROOT / "traces" / "mooncake_conversation.jsonl.gz"
DEFAULT = KVCachePolicySpec().eviction.policy


def wall_time(trace_path: Path, capacities: list[float], repeat: int) -> None:
    trace = read_trace(trace_path)
    print(f"trace {trace_path.name}: {len(trace.requests)} requests; {DEFAULT} against lru, seconds")
    for capacity in capacities:
        seconds: dict[str, list[float]] = {"lru": [], DEFAULT: []}
        ratio: dict[str, float] = {}
        for _ in range(repeat):
            for policy in seconds:
                gc.collect()
                result = replay_pool(trace, policy, capacity)
                seconds[policy].append(result.seconds)
                ratio[policy] = result.token_hit_ratio
        lru, mine = statistics.median(seconds["lru"]), statistics.median(seconds[DEFAULT])
        print(f"capacity {capacity:>6.2%}: lru {lru:.2f} s (hit {ratio['lru']:.4f}), {DEFAULT} {mine:.2f} s "
              f"(hit {ratio[DEFAULT]:.4f}): {mine / lru:.2f}x")


def replay_instructions(trace_path: Path, policy: str | None, capacity: float) -> int:
    """Instructions of this script replaying ``trace_path`` once with ``policy`` (None: load it only)."""
    args = [__file__, "--trace", str(trace_path.resolve()), "--capacity", str(capacity)]
    return instructions(ROOT, args + (["--replay-once", policy] if policy else ["--load-only"]))


def instruction_counts(trace_path: Path, capacities: list[float]) -> None:
    print(f"trace {trace_path.name}: {DEFAULT} against lru, instructions of one replay (cachegrind)")
    runs = [(None, capacities[0])] + [(policy, c) for c in capacities for policy in ("lru", DEFAULT)]
    with ThreadPoolExecutor(os.cpu_count() or 1) as workers:
        counts = dict(zip(runs, workers.map(lambda run: replay_instructions(trace_path, *run), runs), strict=True))
    loading = counts[(None, capacities[0])]
    for capacity in capacities:
        lru, mine = counts[("lru", capacity)] - loading, counts[(DEFAULT, capacity)] - loading
        print(f"capacity {capacity:>6.2%}: lru {lru / 1e9:.2f}e9, {DEFAULT} {mine / 1e9:.2f}e9: {mine / lru:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--capacity", type=float, action="append")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--instructions", action="store_true", help="count instructions (cachegrind), not seconds")
    parser.add_argument("--replay-once", metavar="POLICY", help=argparse.SUPPRESS)  # one counted replay
    parser.add_argument("--load-only", action="store_true", help=argparse.SUPPRESS)  # what a count subtracts
    args = parser.parse_args()
    capacities = args.capacity or [0.01, 0.05, 0.2]
    if args.replay_once or args.load_only:
        trace = read_trace(args.trace)
        if args.replay_once:
            replay_pool(trace, args.replay_once, capacities[0])
    elif args.instructions:
        instruction_counts(args.trace, capacities)
    else:
        wall_time(args.trace, capacities, args.repeat)


if __name__ == "__main__":
    main()
