"""Routing decision cost and ring balance.

    .venv/bin/python bench/routing.py [--trace traces/mooncake_conversation.jsonl.gz]

Per mode: microseconds per decision (prefix key included) over the trace's requests, and, per pod
count, how evenly the ring spreads the trace's distinct keys and how many move when a pod joins.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from pathlib import Path

from kvpool_sidecar.config import Routing
from kvpool_sidecar.replay import read_trace
from kvpool_sidecar.routing import ROUTING_MODES, HashRing, KeySpec, Router, key_movement, key_position

TRACE = Path(__file__).resolve().parents[1] / "traces" / "mooncake_conversation.jsonl.gz"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    trace = read_trace(args.trace)
    reqs = trace.requests
    pods = [f"pod-{i}" for i in range(8)]
    print(f"{trace.name}: {len(reqs)} requests, 8 pods")
    for mode in ROUTING_MODES:
        runs = []
        for _ in range(args.repeat):
            router = Router(Routing(hotPrefixQPS=0.3), KeySpec(trace.block_size, isolate=False), mode=mode, pods=pods)
            start = time.perf_counter()
            for r in reqs:
                router.route(block_hashes=r.hash_ids, num_tokens=r.input_length, meta=r.meta, now=r.timestamp)
            runs.append((time.perf_counter() - start) / len(reqs))
        print(f"  {mode:<24} {statistics.median(runs) * 1e6:6.1f} us per decision (median of {args.repeat})")
    router = Router(Routing(), KeySpec(trace.block_size, isolate=False), pods=pods)
    keys = {key_position(k) for r in reqs
            if (k := router.prefix_key(block_hashes=r.hash_ids, num_tokens=r.input_length)) is not None}
    for n in (4, 8, 16, 32):
        names = [f"pod-{i}" for i in range(n)]
        ring = HashRing(160, names)
        owners = Counter(ring.owner(k) for k in keys)
        joined = HashRing(160, [*names, "new"])
        print(f"  {n:>2} pods: keys per pod max/mean {max(owners.values()) / (len(keys) / n):.3f}; a pod joining "
              f"moves {key_movement(keys, ring, joined):.1%} of {len(keys)} keys (1/(N+1) = {1 / (n + 1):.1%})")


if __name__ == "__main__":
    main()
