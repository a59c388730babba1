"""Instruction counts (cachegrind) of the pool benchmarks for two commits, side by side, with ratios.

    .venv/bin/python bench/instructions.py BEFORE AFTER     # commits; "worktree" is this checkout

Wall time on these machines swings by 30 %; instruction counts of one script in one checkout repeat to
about 1e-5, but the same commit measured alone (or from this checkout rather than a temporary
worktree) came out up to 0.6 % apart: compare only the two columns of one run. Each figure is a
difference of two runs, so that start-up and loading cancel out:

* ``pool_ops``: the conversation trace replayed once through an LRU pool at 5 % (``bench/pool_ops.py
  --repeat 1`` minus ``--repeat 0``);
* ``eviction``: 20,000 evictions from a full pool of 200,000 pages under the default policy
  alone (``bench/eviction.py --alone --evictions 20000`` minus ``--evictions 0``; before ``--alone``
  the first count also held an LRU pool's fill and evictions);
* ``replay``: the conversation trace replayed once through a pool at 2 % with the default policy, its
  counts, curves and self-tuner's shadows (``bench/replay_time.py --replay-once workload_adaptive``
  minus ``--load-only``).

Both commits run this checkout's benchmark scripts, each against its own package (PYTHONPATH).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

from worktrees import checked_out

ROOT = Path(__file__).resolve().parents[1]
BENCHES = {
    "pool_ops": (["bench/pool_ops.py", "--capacity", "0.05", "--memory-pages", "0", "--repeat"], ["1"], ["0"]),
    "eviction": (["bench/eviction.py", "--policy", "workload_adaptive", "--alone", "--pages", "200000", "--evictions"],
                 ["20000"], ["0"]),
    "replay": (["bench/replay_time.py", "--capacity", "0.02"], ["--replay-once", "workload_adaptive"], ["--load-only"]),
}


def instructions(source: Path, args: list[str]) -> int:
    env = {**os.environ, "PYTHONPATH": str(source / "sidecar"), "PYTHONHASHSEED": "0"}
    done = subprocess.run(["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
                           sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    match = re.search(r"I\s+refs:\s+([\d,]+)", done.stderr)
    if done.returncode or match is None:
        raise SystemExit(f"{source}: {' '.join(args)} failed:\n{done.stderr[-2000:]}")
    return int(match.group(1).replace(",", ""))


def measure(source: Path) -> dict[str, int]:
    out = {}
    for name, (args, loaded, empty) in BENCHES.items():
        out[name] = instructions(source, [*args, *loaded]) - instructions(source, [*args, *empty])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before")
    parser.add_argument("after")
    args = parser.parse_args()
    results = []
    for commit in (args.before, args.after):
        with checked_out(commit) as tree:
            results.append(measure(tree))
    before, after = results
    print(f"{'benchmark':<10} {'before':>16} {'after':>16} {'after/before':>13}   ({args.before} -> {args.after})")
    for name in BENCHES:
        print(f"{name:<10} {before[name]:>16,} {after[name]:>16,} {after[name] / before[name]:>13.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
