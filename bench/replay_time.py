"""Replay time of the default policy (self-tuning and its shadows included) against LRU's, in one run.

    .venv/bin/python bench/replay_time.py [--capacity 0.05 --capacity 0.2] [--repeat 3]

Replays the conversation trace through the real pool with each policy, alternating the two, and prints
the median seconds of each and their ratio (the issue-19 bound: at most 3x LRU's). Timings on a shared
machine swing; the ratio of medians taken in alternation is what holds.
"""

from __future__ import annotations

import argparse
import gc
import statistics
from pathlib import Path

from kvpool_sidecar.config import KVCachePolicySpec
from kvpool_sidecar.replay import read_trace, replay_pool

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--capacity", type=float, action="append")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    trace = read_trace(args.trace)
    default = KVCachePolicySpec().eviction.policy
    print(f"trace {args.trace.name}: {len(trace.requests)} requests; {default} against lru")
    for capacity in args.capacity or [0.01, 0.05, 0.2]:
        seconds: dict[str, list[float]] = {"lru": [], default: []}
        ratio: dict[str, float] = {}
        for _ in range(args.repeat):
            for policy in seconds:
                gc.collect()
                result = replay_pool(trace, policy, capacity)
                seconds[policy].append(result.seconds)
                ratio[policy] = result.token_hit_ratio
        lru, mine = statistics.median(seconds["lru"]), statistics.median(seconds[default])
        print(f"capacity {capacity:>6.2%}: lru {lru:.2f} s (hit {ratio['lru']:.4f}), {default} {mine:.2f} s "
              f"(hit {ratio[default]:.4f}): {mine / lru:.2f}x")


if __name__ == "__main__":
    main()
