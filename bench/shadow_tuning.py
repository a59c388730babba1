"""A prototype of issue 19's self-tuning, measured through the real pool: the live policy follows the
better of two sampled shadow pools (LRU, workload_aware), with hysteresis. Not wired into the sidecar.

    .venv/bin/python bench/shadow_tuning.py TRACE [CAPACITY ...]
    .venv/bin/python bench/shadow_tuning.py ../shared/traces/mooncake_synthetic.jsonl 0.01 0.05

A request whose first block id hashes into 1/``--sample`` of the space is also served by each shadow,
a ``PagePool`` of 1/``--sample`` of the capacity running one candidate policy. Each shadow keeps hit
and looked-up tokens decayed over ``--horizon`` sampled requests; when another candidate's ratio
beats the live one's by ``--margin`` (relative), the live pool switches policy in place
(``PagePool.reconfigure``: no cached page is lost). Prints, per capacity, the token hit ratio of fixed
LRU, fixed workload_aware and the tuned pool, and the tuned pool's gap to LRU.
"""

from __future__ import annotations

import argparse

from kvpool_sidecar.pool import PagePool
from kvpool_sidecar.replay import read_trace
from kvpool_sidecar.replay.run import capacity_pages, serve_request, trace_spec
from kvpool_sidecar.replay.trace import Trace

CANDIDATES = ("lru", "workload_aware")


def replay(trace: Trace, capacity: float, fixed: str | None, sample: int, horizon: int, margin: float
           ) -> tuple[float, int]:
    """(token hit ratio, switches) of one pool: ``fixed`` runs one policy; None tunes between them."""
    pages, _ = capacity_pages(trace, capacity)
    specs = {p: trace_spec(trace, p) for p in CANDIDATES}
    current = fixed or "workload_aware"
    live = PagePool(pages, specs[current], clock=lambda: 0.0)
    shadows = {p: PagePool(max(1, pages // sample), specs[p], clock=lambda: 0.0) for p in CANDIDATES}
    score = {p: [0.0, 0.0] for p in CANDIDATES}
    decay = 1.0 - 1.0 / horizon
    hit = total = switches = 0
    for i, req in enumerate(trace.requests):
        hit += serve_request(live, str(i), req).cached
        total += req.input_length
        if fixed or (int(req.hash_ids[0]) * 2654435761) % (1 << 32) % sample:
            continue
        for policy, shadow in shadows.items():
            acc = score[policy]
            acc[0] = acc[0] * decay + serve_request(shadow, str(i), req).cached
            acc[1] = acc[1] * decay + req.input_length
        ratio = {p: acc[0] / acc[1] if acc[1] else 0.0 for p, acc in score.items()}
        best = max(ratio, key=ratio.__getitem__)
        if best != current and ratio[best] > ratio[current] * (1 + margin):
            live.reconfigure(specs[best])
            current = best
            switches += 1
    return hit / total, switches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace")
    parser.add_argument("capacity", nargs="*", type=float, default=[0.01, 0.05, 0.2])
    parser.add_argument("--sample", type=int, default=8, help="1/N of the prefixes and of the capacity")
    parser.add_argument("--horizon", type=int, default=1000, help="sampled requests the scores decay over")
    parser.add_argument("--margin", type=float, default=0.02, help="relative gain a switch needs")
    args = parser.parse_args()
    trace = read_trace(args.trace)
    for capacity in args.capacity:
        lru, _ = replay(trace, capacity, "lru", args.sample, args.horizon, args.margin)
        wa, _ = replay(trace, capacity, "workload_aware", args.sample, args.horizon, args.margin)
        tuned, switches = replay(trace, capacity, None, args.sample, args.horizon, args.margin)
        print(f"{trace.name} {capacity:g}: lru {lru:.4f}  workload_aware {wa:.4f}  tuned {tuned:.4f} "
              f"({switches} switches)  tuned - lru {tuned - lru:+.4f}", flush=True)


if __name__ == "__main__":
    main()
