"""Is a page's count a reuse signal here? P(reused soon | count) and the traffic's shape, by trace segment.

    .venv/bin/python bench/count_signal.py [--trace T ...] [--requests 4000] [--within 400] [--segments 8]

For each request and each of its pages, the page's count (requests that have contained it, this one
included, counted exactly) and whether a request among the next ``--within`` contains it again; pages
of the last ``--within`` requests are left out (their future is cut off). Prints, per equal segment of
the requests, the reuse rate by count class (1, 2, 3-4, 5-8, 9+; pages in brackets), the seconds the
segment spans, its pages per second and its share of later turns (``turn`` > 0).

The workload-aware policy credits pages by count: that pays where the rate rises with the count and
costs where it is flat (every credit then only holds older pages over newer ones an LRU would keep).
A trace is a shipped file name or ``profile:seed`` for a ``synth`` trace of ``--requests`` requests.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

from kvpool_sidecar.replay.trace import Trace
from policy_matrix import load

CLASSES = ("1", "2", "3-4", "5-8", "9+")


def count_class(count: int) -> int:
    """The index in :data:`CLASSES` of a count of at least 1."""
    if count <= 2:
        return count - 1
    return 2 if count <= 4 else 3 if count <= 8 else 4


def reuse_by_count(trace: Trace, within: int, bounds: list[int]) -> list[list[tuple[int, int]]]:
    """Per segment ``bounds[k]:bounds[k + 1]`` of the requests, per count class: (pages, pages
    contained again within ``within`` requests)."""
    requests = trace.requests
    n = len(requests)
    next_use: list[list[int]] = [[] for _ in range(n)]
    seen_at: dict[int, int] = {}
    for i in range(n - 1, -1, -1):  # backwards: each page's next request is the last one seen
        next_use[i] = [seen_at.get(h, n + within) for h in requests[i].hash_ids]
        for h in requests[i].hash_ids:
            seen_at[h] = i
    counts: defaultdict[int, int] = defaultdict(int)
    out: list[list[tuple[int, int]]] = []
    for start, end in zip(bounds, bounds[1:], strict=False):
        row = [(0, 0)] * len(CLASSES)
        for i in range(start, end):
            for h, later in zip(requests[i].hash_ids, next_use[i], strict=True):
                counts[h] += 1
                if i + within < n:
                    k = count_class(counts[h])
                    pages, reused = row[k]
                    row[k] = (pages + 1, reused + (later - i <= within))
        out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", action="append", help="file name in traces/ or profile:seed")
    parser.add_argument("--requests", type=int, default=4000, help="requests per synth trace")
    parser.add_argument("--within", type=int, default=400, help="reuse counted within this many requests")
    parser.add_argument("--segments", type=int, default=8)
    args = parser.parse_args()
    if args.within < 1 or args.segments < 1 or args.requests < 1:
        parser.error("--within, --segments and --requests must be at least 1")
    for name in args.trace or ["mooncake_conversation.jsonl.gz", "to-c:2"]:
        trace = load(name, args.requests)
        requests = trace.requests
        n = len(requests)
        print(f"\n{name}: P(reused within {args.within} requests | count), by segment of requests")
        print(f"{'requests':>13} {'seconds':>8} {'pages/s':>8} {'later':>6}  " + "".join(f"{c:>15}" for c in CLASSES))
        bounds = [n * k // args.segments for k in range(args.segments + 1)]
        for start, end, row in zip(bounds, bounds[1:], reuse_by_count(trace, args.within, bounds), strict=False):
            if end <= start:
                continue
            span = requests[end - 1].timestamp - requests[start].timestamp
            pages = sum(len(r.hash_ids) for r in requests[start:end])
            later = sum(r.meta.turn > 0 for r in requests[start:end]) / (end - start)
            rates = "".join(f"{(hit / seen if seen else float('nan')):>7.2f} ({seen:>5})" for seen, hit in row)
            print(f"{start:>6}-{end:<6} {span:8.0f} {pages / max(span, 1e-9):8.0f} {later:6.0%}  {rates}")

if __name__ == "__main__":
    main()
