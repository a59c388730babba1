"""Routing on KV events, 4 pods: a router that reads kvpool's events (medium CPU) against one that sees only
the engines' own (GPU) tier, on real traces through the real pool code
(``dev/kv_event_sim.py``).

    .venv/bin/python bench/event_routing.py
    .venv/bin/python bench/event_routing.py --pods 8 --gpu-fraction 0.5 --capacities 0.02 0.1

Prints per trace and kvpool capacity (over all pods, a share of the trace's distinct blocks): the token
hit ratio (either tier), kvpool's share of the hits, how often a request whose history a kvpool held
beyond every GPU tier was sent to that pod, and the load imbalance (busiest pod over the mean).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from kvpool_sidecar.replay.trace import read_trace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "dev"))  # what tests, benchmarks and the demo share
from kv_event_sim import ROUTERS, replay_event_routing

TRACES = Path(__file__).resolve().parents[1] / "traces"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", nargs="+", type=Path,
                    default=[TRACES / "mooncake_conversation.jsonl.gz", TRACES / "mooncake_synthetic.jsonl.gz"])
    ap.add_argument("--capacities", nargs="+", type=float, default=[0.01, 0.02, 0.05, 0.1, 0.2])
    ap.add_argument("--pods", type=int, default=4)
    ap.add_argument("--gpu-fraction", type=float, default=0.25, help="each GPU tier as a share of its kvpool")
    args = ap.parse_args(argv)
    print(f"{args.pods} pods, GPU tier = {args.gpu_fraction:g} x kvpool per pod, kvpool's shipped default policy")
    print(f"{'trace':<26} {'kvpool':>7} {'router':<9} {'hit ratio':>9} {'kvpool share':>12} "
          f"{'history followed':>16} {'imbalance':>9} {'s':>5}")
    for path in args.traces:
        trace = read_trace(path)
        for capacity in args.capacities:
            rows = {}
            for router in ROUTERS:
                start = time.perf_counter()
                r = replay_event_routing(trace, router, capacity, args.pods, args.gpu_fraction)
                rows[router] = r
                print(f"{path.stem:<26} {capacity:>7.0%} {router:<9} {r.token_hit_ratio:>9.4f} "
                      f"{r.kvpool_token_ratio:>12.3f} {r.kvpool_history_followed:>9.3f} "
                      f"of {r.kvpool_history_requests:<5}"
                      f"{r.imbalance:>9.3f} {time.perf_counter() - start:>5.1f}")
            a, b = rows["events"].token_hit_ratio, rows["gpu-only"].token_hit_ratio
            print(f"{'':<26} {'':>7} {'ratio':<9} {a / b if b else float('inf'):>9.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
