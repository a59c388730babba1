"""Where the self-tuner gains or loses against the fixed candidates: token hit ratio by trace segment.

    .venv/bin/python bench/tuner_phases.py [--trace T] [--capacity 0.05] [--segments 8] [--weight 0.1 ...]

Replays the trace through the real pool with LRU, the self-tuned default and each candidate reuse weight
held fixed (``--weight``, default all candidates), and prints each one's token hit ratio over equal
segments of the requests, the weight the tuner had in force at each segment's end and the requests at
which it switched. A gap that lies before the first switch is the tuner's start on LRU; one after it
is a wrong choice or the cost of a switch.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvpool_sidecar.config import KVCachePolicySpec
from kvpool_sidecar.pool import PagePool
from kvpool_sidecar.replay import read_trace
from kvpool_sidecar.replay.run import capacity_pages, serve_request, trace_spec
from kvpool_sidecar.replay.trace import Trace
from kvpool_sidecar.replay.tune import adaptive_spec

TRACE = Path(__file__).resolve().parents[1] / "traces" / "mooncake_conversation.jsonl.gz"


def cached_tokens(trace: Trace, pages: int, policy: str, spec: KVCachePolicySpec | None,
                  watch: list[tuple[int, str]] | None = None) -> list[int]:
    """Each request's cached tokens; ``watch`` gets (request, weights in force) at each switch of the
    self-tuner (the tuned run)."""
    pool = PagePool(pages, trace_spec(trace, policy, spec), clock=lambda: 0.0)
    out: list[int] = []
    switches = 0
    for i, req in enumerate(trace.requests):
        out.append(serve_request(pool, str(i), req).cached)
        if watch is not None and sum(pool.frequencies.tuning_switches) != switches:
            switches = sum(pool.frequencies.tuning_switches)
            watch.append((i, ", ".join(f"{part} {state['reuse_weight']:g}" for part, state in pool.tuning().items())))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--capacity", type=float, default=0.05)
    parser.add_argument("--segments", type=int, default=8)
    parser.add_argument("--weight", type=float, action="append", help="a fixed reuse weight to compare")
    args = parser.parse_args()
    if args.segments < 1:
        parser.error("--segments must be at least 1")
    trace = read_trace(args.trace)
    pages, fraction = capacity_pages(trace, args.capacity)
    base = KVCachePolicySpec()
    switches: list[tuple[int, str]] = []
    runs = {"lru": cached_tokens(trace, pages, "lru", None),
            "tuned": cached_tokens(trace, pages, "workload_adaptive", adaptive_spec(base, None), switches)}
    for weight in args.weight or base.eviction.selfTuning.candidates(to_b=False):
        runs[f"w={weight:g}"] = cached_tokens(trace, pages, "workload_adaptive", adaptive_spec(base, weight))
    tokens = [r.input_length for r in trace.requests]
    n = len(tokens)
    print(f"trace {args.trace.name}, {pages} pages ({fraction:.2%}): token hit ratio by segment of requests")
    print(f"{'requests':>13} {'tokens':>6} " + " ".join(f"{name:>7}" for name in runs))
    bounds = [n * k // args.segments for k in range(args.segments + 1)]
    for start, end in zip(bounds, bounds[1:], strict=False):
        total = sum(tokens[start:end]) or 1
        print(f"{start:>6}-{end:<6} {total / sum(tokens):6.1%} "
              + " ".join(f"{sum(hits[start:end]) / total:7.4f}" for hits in runs.values()))
    print(f"{'all':>13} {'':>6} " + " ".join(f"{sum(hits) / sum(tokens):7.4f}" for hits in runs.values()))
    print("tuner switches: " + ("; ".join(f"request {i}: {weights}" for i, weights in switches[:20]) or "none"))


if __name__ == "__main__":
    main()
