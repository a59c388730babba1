"""Never below LRU: a policy against LRU on every shipped trace and synth profile, at every capacity.

    .venv/bin/python bench/policy_matrix.py [--policy workload_adaptive] [--seeds 1,2,3,4]
        [--no-shipped] [--requests 10000] [--capacity 0.0025 ...] [--jobs 2] [--json out.json]

Runs the real pool (``replay_pool``) on the two shipped Mooncake traces and on ``synth`` traces of
every profile (to-c, to-b, mixed and the adversarial to-b-burst and scan) for each seed, LRU and
each policy in the same run, and prints each policy's token hit ratio minus LRU's per cell, then the
worst cell per trace. The rule of issue 19: never below LRU by more than 0.002. Its seeds are 1-4;
``--seeds 5,6,7,8 --no-shipped`` holds the policy to synth traces no one tuned it on.
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from kvpool_sidecar.replay import read_trace, synth
from kvpool_sidecar.replay.run import SETUPS, replay_pool
from kvpool_sidecar.replay.trace import Trace, parse_lines

TRACES = Path(__file__).resolve().parents[1] / "traces"
CAPACITIES = (0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2)
TOLERANCE = 0.002


def load(name: str, requests: int) -> Trace:
    """A shipped trace by file name, or ``profile:seed`` for a synth trace of ``requests`` requests."""
    if ":" in name:
        profile, seed = name.split(":")
        return parse_lines(synth.generate(profile, requests, int(seed)), name)
    return read_trace(TRACES / name)


def cell(args: tuple[str, int, str, float, str]) -> tuple[str, str, float, float, float]:
    name, requests, policy, capacity, setup = args
    result = replay_pool(load(name, requests), policy, capacity, setup=setup)
    return name, policy, capacity, result.token_hit_ratio, result.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", action="append", help="policies against LRU (default workload_adaptive)")
    parser.add_argument("--seeds", default="1,2,3,4")
    parser.add_argument("--no-shipped", action="store_true", help="synth traces only (not the shipped two)")
    parser.add_argument("--requests", type=int, default=10_000, help="requests per synth trace")
    parser.add_argument("--capacity", type=float, action="append")
    parser.add_argument("--trace", action="append", help="only these (file names or profile:seed)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--json", help="write the cells here")
    parser.add_argument("--verbose", action="store_true", help="each cell to stderr as it comes")
    parser.add_argument("--setup", choices=SETUPS, default="shipped",
                        help="shipped: the spec as a user gets it; reference: auto-pins and one-class to-B share off")
    args = parser.parse_args()
    if args.no_shipped and args.trace:
        parser.error("--no-shipped: --trace names the traces itself (give one or the other)")
    policies = args.policy or ["workload_adaptive"]
    capacities = args.capacity or list(CAPACITIES)
    shipped = [] if args.no_shipped else ["mooncake_conversation.jsonl.gz", "mooncake_synthetic.jsonl.gz"]
    names = args.trace or (shipped + [f"{p}:{s}" for p in synth.PROFILES for s in args.seeds.split(",")])
    work = [(n, args.requests, p, c, args.setup) for n in names for c in capacities for p in ["lru", *policies]]
    ratios: dict[tuple[str, str, float], float] = {}
    seconds: dict[str, float] = {}
    with ProcessPoolExecutor(args.jobs) as pool:
        for name, policy, capacity, ratio, took in pool.map(cell, work):
            ratios[name, policy, capacity] = ratio
            seconds[policy] = seconds.get(policy, 0.0) + took
            if policy != "lru" and args.verbose:
                gain = ratio - ratios[name, "lru", capacity]
                print(f"  {name} {capacity:.4f} {policy}: {ratio:.4f} ({gain:+.4f})", file=sys.stderr, flush=True)
    caps = "".join(f"{c * 100:>9.2f}%" for c in capacities)
    failed = 0
    for policy in policies:
        print(f"\n{policy} minus LRU (token hit ratio); LRU in brackets\n{'trace':<30}{caps}   worst")
        for name in names:
            gains = [ratios[name, policy, c] - ratios[name, "lru", c] for c in capacities]
            row = "".join(f"{g:>+10.4f}" for g in gains)
            worst = min(gains)
            failed += worst < -TOLERANCE
            mark = "  BELOW" if worst < -TOLERANCE else ""
            print(f"{name:<30}{row}{worst:>+8.4f}{mark}")
            print(f"{'':<30}" + "".join(f"{'(' + format(ratios[name, 'lru', c], '.4f') + ')':>10}" for c in capacities))
        print(f"replay seconds in all: {policy} {seconds[policy]:.0f}, lru {seconds['lru']:.0f}")
    print(f"\ncells more than {TOLERANCE} below LRU: {failed} trace rows (setup: {args.setup})")
    if args.json:
        Path(args.json).write_text(json.dumps([[n, p, c, r] for (n, p, c), r in ratios.items()]))
    sys.exit(0)


if __name__ == "__main__":
    main()
