"""Drift reports on a steady workload and on one that changes, replayed through the real pool.

    .venv/bin/python bench/drift.py [--requests 6000] [--capacity 0.01 --capacity 0.2]

Each trace is two synthetic segments of ``--requests`` requests, the second one right after the first
(its own chats, prompts and block ids): ``steady`` keeps the reuse gaps, ``faster`` makes them 4x
shorter in the second segment, ``slower`` 5x longer. A detector that works reports nothing before the
change (and little in the steady one) and reports after it. Prints, per trace and capacity, the
drift reports before and after the change and the classes reported.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

from kvpool_sidecar.pool import PagePool
from kvpool_sidecar.replay.run import capacity_pages, replay_pool, replay_spec
from kvpool_sidecar.replay.synth import generate
from kvpool_sidecar.replay.trace import Trace, parse_lines
from kvpool_sidecar.workload import DriftEvent

CASES = {  # name -> (profile, gap scale of the second segment)
    "to-c steady": ("to-c", 1.0),
    "to-c faster": ("to-c", 4.0),
    "to-b steady": ("to-b", 1.0),
    "to-b slower": ("to-b", 0.2),
}


def two_segments(profile: str, requests: int, gap_scale: float) -> tuple[Trace, float]:
    """The trace and the time its second segment starts."""
    first = [json.loads(line) for line in generate(profile, requests, seed=1)]
    second = [json.loads(line) for line in generate(profile, requests, seed=2, gap_scale=gap_scale)]
    start = first[-1]["timestamp"] + 1.0
    id_offset = 1 + max(h for row in first for h in row["hash_ids"])
    chat_offset = 1 + max(row["chat_id"] for row in first)
    for row in second:
        row["timestamp"] += start
        row["hash_ids"] = [h + id_offset for h in row["hash_ids"]]
        row["chat_id"] += chat_offset
        if row["parent_chat_id"] >= 0:
            row["parent_chat_id"] += chat_offset
        row["user"] = "b-" + row["user"]
    trace = parse_lines((json.dumps(row) for row in first + second), f"{profile}-x{gap_scale}")
    return trace, start


def drift_reports(trace: Trace, capacity: float) -> list[DriftEvent]:
    pages, _ = capacity_pages(trace, capacity)
    spec = replay_spec("workload_adaptive", trace.block_size, None, single_class=True)
    pool = PagePool(pages, spec, clock=lambda: 0.0)
    events: list[DriftEvent] = []
    pool.model.on_drift = events.append
    replay_pool(trace, "workload_adaptive", capacity, pool=pool)
    return events


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=6000, help="requests per segment")
    parser.add_argument("--capacity", type=float, action="append")
    args = parser.parse_args()
    capacities = args.capacity or [0.01, 0.2]
    print(f"{'trace':<14}{'capacity':>9}{'before':>8}{'after':>7}   change at   classes reported")
    for name, (profile, gap_scale) in CASES.items():
        trace, change = two_segments(profile, args.requests, gap_scale)
        for capacity in capacities:
            events = drift_reports(trace, capacity)
            before = sum(e.at < change for e in events)
            classes = Counter(e.klass for e in events)
            print(
                f"{name:<14}{capacity:>9}{before:>8}{len(events) - before:>7}   {change:>7.0f} s   "
                + ", ".join(f"{k}: {n}" for k, n in sorted(classes.items(), key=str)),
                flush=True,
            )


if __name__ == "__main__":
    main()
