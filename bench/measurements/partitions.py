"""The to-B partition as a floor to-C may borrow, against the hard partition of an earlier commit.

    .venv/bin/python bench/measurements/partitions.py                 # against 0498f80 (the last hard partition)
    .venv/bin/python bench/measurements/partitions.py --before COMMIT --seeds 13 14 15 16

Prints, side by side in one run:

1. to-C-only traffic with the shipped defaults (the default spec, its 30 % to-B share, auto-pins on):
   the share of the pool cached at the end and the token hit ratio, against the same spec with
   ``isolationPercent: 0``, on the conversation trace at 1-20 % and on ``synth to-c`` seeds.
2. Mixed traffic, a to-C flood followed by to-B bursts (``synth to-c`` then ``synth to-b-burst``, one
   trace per seed) and ``synth mixed``: each class's hit ratio here and at ``--before`` (whose replay
   ran the reference setup: auto-pins off), both in the reference setup so that only the partition
   rule differs.

Replays go through each commit's own ``kvpool-sidecar replay`` (the CLI both share), as
``bench/replay_cells.py`` does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/
from replay_cells import cli
from worktrees import ROOT, checked_out

TRACES = ROOT / "traces"
CAPACITIES = ("0.01", "0.02", "0.05", "0.1", "0.2")
FLOOD_CAPACITIES = ("0.02", "0.05", "0.2")


def replay(source: Path, trace: Path, capacities: tuple[str, ...], *extra: str) -> list[dict]:
    args = ["replay", str(trace), "--format", "json", "--no-progress", "--policy", "workload_adaptive", *extra]
    for capacity in capacities:
        args += ["--capacity", capacity]
    text = cli(source, args).strip()
    return json.loads(text) if text.startswith("[") else [json.loads(line) for line in text.splitlines()]


def flood_then_bursts(workdir: Path, seed: int) -> Path:
    """``synth to-c`` (3,000 requests), then ``synth to-b-burst`` (1,500) starting after its last one."""
    paths = {}
    for profile, n in (("to-c", 3000), ("to-b-burst", 1500)):
        paths[profile] = workdir / f"{profile}-{seed}.jsonl"
        cli(ROOT, ["synth", "--profile", profile, "--requests", str(n), "--seed", str(seed), "-o", str(paths[profile])])
    to_c = [json.loads(line) for line in paths["to-c"].read_text().splitlines()]
    to_b = [json.loads(line) for line in paths["to-b-burst"].read_text().splitlines()]
    shift = max(r["timestamp"] for r in to_c) + 1.0
    offset = 1 + max(h for r in to_c for h in r["hash_ids"])  # no id of the bursts collides with a chat's
    for r in to_b:
        r["timestamp"] = round(r["timestamp"] + shift, 3)
        r["hash_ids"] = [h + offset for h in r["hash_ids"]]
        r["class"] = "to-b"
    out = workdir / f"flood-{seed}.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in to_c + to_b))
    return out


def to_c_only(workdir: Path, seeds: list[int]) -> None:
    zero = workdir / "isolation0.yaml"
    zero.write_text("workloads:\n  toB:\n    isolationPercent: 0\n")
    traces = [TRACES / "mooncake_conversation.jsonl.gz"]
    for seed in seeds:
        path = workdir / f"to-c-{seed}.jsonl"
        cli(ROOT, ["synth", "--profile", "to-c", "--requests", "3000", "--seed", str(seed), "-o", str(path)])
        traces.append(path)
    print("1. to-C-only traffic, shipped defaults vs isolationPercent 0 (default policy, auto-pins on)")
    print(f"{'trace':<30}{'capacity':>9}{'shipped':>10}{'isol. 0':>10}{'diff':>9}")
    diffs = []
    for trace in traces:
        shipped = replay(ROOT, trace, CAPACITIES)
        flat = replay(ROOT, trace, CAPACITIES, "--config", str(zero))
        for a, b in zip(shipped, flat, strict=True):
            diff = a["token_hit_ratio"] - b["token_hit_ratio"]
            diffs.append(diff)
            print(f"{trace.name:<30}{a['capacity_fraction']:>9.2%}{a['token_hit_ratio']:>10.4f}"
                  f"{b['token_hit_ratio']:>10.4f}{diff:>+9.4f}")
    print(f"shipped - isolation 0: min {min(diffs):+.4f}, max {max(diffs):+.4f} over {len(diffs)} cells\n")


def mixed(workdir: Path, seeds: list[int], before: str) -> None:
    traces = [flood_then_bursts(workdir, seed) for seed in seeds]
    for seed in seeds:
        path = workdir / f"mixed-{seed}.jsonl"
        cli(ROOT, ["synth", "--profile", "mixed", "--requests", "3000", "--seed", str(seed), "-o", str(path)])
        traces.append(path)
    print(f"2. mixed traffic, per class: work-conserving (this checkout) vs hard partition ({before}),"
          " reference setup")
    print(f"{'trace':<22}{'capacity':>9}{'toB now':>9}{'toB then':>10}{'diff':>9}{'toC now':>9}{'toC then':>10}"
          f"{'diff':>9}")
    deltas: dict[str, list[float]] = {"toB": [], "toC": []}
    with checked_out(before) as old:
        for trace in traces:
            now = replay(ROOT, trace, FLOOD_CAPACITIES, "--setup", "reference")
            then = replay(old, trace, FLOOD_CAPACITIES)
            for a, b in zip(now, then, strict=True):
                line = f"{trace.name:<22}{a['capacity_fraction']:>9.2%}"
                for klass in ("toB", "toC"):
                    x, y = a["per_class"].get(klass, 0.0), b["per_class"].get(klass, 0.0)
                    deltas[klass].append(x - y)
                    line += f"{x:>9.4f}{y:>10.4f}{x - y:>+9.4f}"
                print(line)
    for klass, values in deltas.items():
        print(f"{klass} now - then: min {min(values):+.4f}, max {max(values):+.4f}, "
              f"mean {statistics.fmean(values):+.4f} over {len(values)} cells")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default="0498f80", help="a commit with the hard partition")
    parser.add_argument("--seeds", type=int, nargs="+", default=[13, 14, 15, 16], help="synth seeds (unseen)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        to_c_only(Path(tmp), args.seeds)
        mixed(Path(tmp), args.seeds, args.before)
    return 0


if __name__ == "__main__":
    sys.exit(main())
